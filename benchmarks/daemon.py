"""The benchmarks' Python worker daemon (``spark.python.daemon.module``).

The runner's own SparkContext forks its Python workers from
``beam_pyspark.spark.daemon``, which imports Beam once before the first
fork; a context the benchmarks start must do the same to measure what a
user of the runner gets. But Spark starts a daemon per worker pool, with
the pool's environment, and the hand-written jobs' pool
(``workloads.handwritten_pool``: ``POOL_VARIABLE`` set) must stay a plain
PySpark one whose workers never hold Beam. So: the runner's preload in
every pool but that one, then PySpark's own daemon.

Without it the runner's workers each imported Beam on their first task
(1-4 CPU-s at load 10-40), and PySpark stops a pool's idle workers once
the pool has had nothing to do for a minute (``PythonWorkerFactory``'s
fixed ``IDLE_WORKER_TIMEOUT_NS``): a run of ours more than a minute after
the last one paid that import again (the "cold worker" runs of the load
tests' tables).
"""

import os

# workloads.POOL_VARIABLE (not imported: that module imports Beam).
POOL_VARIABLE = 'BEAM_PYSPARK_BENCH_POOL'

if __name__ == '__main__':
  if not os.environ.get(POOL_VARIABLE):
    try:
      from beam_pyspark.spark import daemon  # pylint: disable=import-outside-toplevel
      daemon._preload()  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      pass  # as the runner's daemon: each worker imports what it needs
  from pyspark.daemon import manager  # pylint: disable=import-outside-toplevel
  manager()
