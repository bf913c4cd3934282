"""A look inside PySpark's Python workers: heap, cached harnesses, GC cost.

No Beam import here: the probe must not change what it looks at.
"""

from __future__ import annotations

import os
import sys
import time


def probe_worker(_index, _records):
  """Inside a Python worker: its heap, cached harnesses and what a full
  collection costs there (PySpark's daemon runs gc.collect() after every
  task of a reused worker)."""
  import gc
  import resource
  harnesses = runtimes = None
  if 'beam_pyspark.worker.harnesses' in sys.modules:
    harnesses = sys.modules['beam_pyspark.worker.harnesses'].count()
  if 'beam_pyspark.worker.runtime' in sys.modules:
    runtimes = len(sys.modules['beam_pyspark.worker.runtime']._runtimes)
  t = time.perf_counter()
  gc.collect()
  collect_s = time.perf_counter() - t
  objects = len(gc.get_objects())
  gc.freeze()
  t = time.perf_counter()
  gc.collect()
  frozen_collect_s = time.perf_counter() - t
  gc.unfreeze()
  yield {
      'pid': os.getpid(),
      'pool': os.environ.get('BEAM_PYSPARK_BENCH_POOL', 'runner'),
      'beam_imported': 'apache_beam' in sys.modules,
      'cached_harnesses': harnesses,
      'cached_job_runtimes': runtimes,
      'gc_objects': objects,
      'gc_collect_s': collect_s,
      'gc_collect_after_freeze_s': frozen_collect_s,
      'max_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  }


def probe_workers(sc, partitions: int = 8) -> list[dict]:
  """Probe the workers of the pool that the context's environment selects."""
  seen = {}
  for r in sc.parallelize(range(partitions), partitions).mapPartitionsWithIndex(
      probe_worker).collect():
    seen.setdefault(r['pid'], r)
  return list(seen.values())




def freeze_worker(_index, _records):
  """Experiment (run --freeze-workers): import what a runner task imports,
  collect, then gc.freeze(), so the daemon's per-task gc.collect() and the
  automatic full collections skip those long-lived objects."""
  import gc
  import apache_beam  # pylint: disable=unused-import
  from apache_beam.runners.worker import bundle_processor  # pylint: disable=unused-import
  from apache_beam.runners.worker import sdk_worker  # pylint: disable=unused-import
  import beam_pyspark.spark.tasks  # pylint: disable=unused-import
  import beam_pyspark.worker.harnesses.embedded  # pylint: disable=unused-import
  gc.collect()
  gc.freeze()
  time.sleep(0.3)  # let the other slot's task land on another worker
  yield os.getpid(), gc.get_freeze_count()


def freeze_workers(sc, partitions: int = 8) -> dict:
  return dict(
      sc.parallelize(range(partitions), partitions)
      .mapPartitionsWithIndex(freeze_worker).collect())
