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
  if 'beam_pyspark.worker.harness' in sys.modules:
    harnesses = len(sys.modules['beam_pyspark.worker.harness']._harnesses)
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


