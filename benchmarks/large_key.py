"""A GroupByKey whose one key holds several times the memory of the executor
and of its Python worker.

    python -m benchmarks.large_key [--hot-gib 6] [--value-kib 8]
        [--executor-memory 1g] [--python-memory 1g]
        [--python-worker-memory 256m] [--variants pyspark,ours]

It starts its own SparkContext (local[2]) with the memory caps:

* ``spark.driver.memory`` = ``spark.executor.memory`` = --executor-memory:
  on a local master the executor lives in the driver's JVM, so the driver's
  heap is the executor's;
* ``spark.executor.pyspark.memory`` = --python-memory: PySpark caps each
  Python worker's address space (RLIMIT_AS) to it;
* ``spark.python.worker.memory`` = --python-worker-memory: where PySpark's
  own Python-side aggregation (groupByKey's merger) spills to disk;
* ``MALLOC_ARENA_MAX`` (--malloc-arenas) in the workers' environment: with
  RLIMIT_AS, glibc's per-thread 64 MiB malloc arenas of a Beam worker's
  threads count against the cap without holding any data.

One key (``hot``) gets --hot-gib of pseudo-random values of --value-kib
each, made by --shards map tasks; a few small keys get one value per shard.
The grouped values are consumed by iterating them once (count, bytes,
crc32), both by hand-written PySpark (``groupByKey``) and by a Beam
pipeline on our runner.  The run reports for each: done or failed (and
how), time, peak RSS of the JVM and of the largest Python worker, and
Spark's spill counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import threading
import time
import traceback

from benchmarks import records
from benchmarks import run as bench_run
from benchmarks import workloads

GIB = 1 << 30


class MemoryWatch:
  """Peak RSS of this process's JVM and of each Python worker, sampled."""
  def __init__(self, interval: float = 0.2):
    import psutil
    self._psutil = psutil
    self.interval = interval
    self.peak_jvm = 0
    self.peak_worker = 0
    self.peak_worker_pid = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()

  def _run(self):
    psutil = self._psutil
    me = psutil.Process()
    while not self._stop.is_set():
      for p in me.children(recursive=True):
        try:
          rss = p.memory_info().rss
          name = p.name()
          cmd = p.cmdline()
          parent = p.parent()
          parent_cmd = parent.cmdline() if parent else []
        except psutil.Error:
          continue
        if name == 'java':
          self.peak_jvm = max(self.peak_jvm, rss)
        elif any('pyspark.daemon' in c for c in cmd) and any(
            'pyspark.daemon' in c for c in parent_cmd):
          # A forked worker (the daemon itself holds no data).
          if rss > self.peak_worker:
            self.peak_worker, self.peak_worker_pid = rss, p.pid
      self._stop.wait(self.interval)


def beam_pipeline(p, shards: int, gen, output: str) -> None:
  import apache_beam as beam
  from apache_beam.io import WriteToText
  (
      p
      | 'Shards' >> beam.Create(list(range(shards)))
      | 'Spread' >> beam.Reshuffle()
      | 'Values' >> beam.FlatMap(gen)
      | 'Group' >> beam.GroupByKey()
      | 'Summarize' >> beam.Map(records.summarize_bytes_group)
      | 'Write' >> WriteToText(output))


def run_ours(sc, shards, gen, output):
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions
  p = beam.Pipeline(options=PipelineOptions(bench_run.our_flags(None)))
  beam_pipeline(p, shards, gen, output)
  p.run().wait_until_finish()


def run_pyspark(sc, shards, gen, output):
  (
      sc.parallelize(range(shards), shards).flatMap(gen).groupByKey()
      .map(records.summarize_bytes_group).saveAsTextFile(output))


def run_pyspark_sorted(sc, shards, gen, output):
  """Hand-written, streaming: sort each partition by key (PySpark's
  ExternalSorter spills sorted runs and merges them lazily), then walk the
  groups with itertools.groupby."""
  (
      sc.parallelize(range(shards), shards).flatMap(gen)
      .repartitionAndSortWithinPartitions(shards)
      .mapPartitions(records.summarize_sorted_groups).saveAsTextFile(output))


def run_ours_parallel(sc, shards, gen, output):
  """Ours with --spark_parallelism=shards, so no map task holds more of the
  hot key than a hand-written one does."""
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions
  p = beam.Pipeline(options=PipelineOptions(
      bench_run.our_flags(shards)))
  beam_pipeline(p, shards, gen, output)
  p.run().wait_until_finish()


VARIANTS = {
    'pyspark': run_pyspark,
    'pyspark_sorted': run_pyspark_sorted,
    'ours': run_ours,
    'ours_parallel': run_ours_parallel,
}



def read_output(output: str) -> list[str]:
  lines = []
  for path in workloads.output_files(output):
    with open(path) as f:
      lines.extend(line.rstrip('\n') for line in f)
  return sorted(lines)


def error_summary(exn: BaseException, limit: int = 25) -> str:
  """The Python part of a Spark failure, else the exception's last lines."""
  text = str(exn)
  start = text.rfind('Traceback (most recent call last)')
  if start >= 0:
    text = text[start:]
    end = text.find('\n\tat ')
    text = text[:end if end > 0 else len(text)]
  lines = [l for l in text.splitlines() if l.strip()]
  head = f'{type(exn).__name__}: '
  if len(lines) > limit:
    return head + '\n'.join(lines[:6] + ['  ...'] + lines[-(limit - 7):])
  return head + '\n'.join(lines)


def spill_totals(rest, since_job: int) -> dict:
  totals = {'memory_spilled_mib': 0.0, 'disk_spilled_mib': 0.0,
            'shuffle_write_mib': 0.0, 'failed_tasks': 0}
  for job in rest.jobs_since(since_job):
    for stage_id in job['stageIds']:
      for s in rest.get(f'stages/{stage_id}'):
        totals['memory_spilled_mib'] += s.get('memoryBytesSpilled', 0) / 2**20
        totals['disk_spilled_mib'] += s.get('diskBytesSpilled', 0) / 2**20
        totals['shuffle_write_mib'] += s.get('shuffleWriteBytes', 0) / 2**20
        totals['failed_tasks'] += s.get('numFailedTasks', 0)
  return totals


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--hot-gib', type=float, default=6.0,
                      help='GiB of values under the one hot key')
  parser.add_argument('--value-kib', type=float, default=8.0)
  parser.add_argument('--shards', type=int, default=24)
  parser.add_argument('--cold-keys', type=int, default=4)
  parser.add_argument('--executor-memory', default='1g')
  parser.add_argument('--python-memory', default='1g',
                      help='spark.executor.pyspark.memory (RLIMIT_AS per worker)')
  parser.add_argument('--python-worker-memory', default='256m',
                      help="spark.python.worker.memory (PySpark's spill point)")
  parser.add_argument('--malloc-arenas', default='2',
                      help="MALLOC_ARENA_MAX of the workers ('' to leave unset)")
  parser.add_argument('--master', default='local[2]')
  parser.add_argument(
      '--variants', default='pyspark,pyspark_sorted,ours,ours_parallel',
      help='of: ' + ', '.join(VARIANTS))
  parser.add_argument('--timeout', type=float, default=3600,
                      help='cancel a variant after this many seconds')
  parser.add_argument('--out', default=os.path.join('out', 'bench'))
  args = parser.parse_args(argv)

  value_bytes = int(args.value_kib * 1024)
  per_shard = max(1, int(args.hot_gib * GIB / value_bytes / args.shards))
  gen = records.KeyedValues(per_shard, value_bytes, args.cold_keys)
  hot_count = per_shard * args.shards
  expected_hot = (hot_count, hot_count * value_bytes)
  conf = {
      'spark.driver.memory': args.executor_memory,
      'spark.executor.memory': args.executor_memory,
      'spark.executor.pyspark.memory': args.python_memory,
      'spark.python.worker.memory': args.python_worker_memory,
  }
  if args.malloc_arenas:
    conf['spark.executorEnv.MALLOC_ARENA_MAX'] = args.malloc_arenas
  session = bench_run.start_spark(args.master, conf)
  sc = session.sparkContext
  from benchmarks.profile import SparkRest
  rest = SparkRest(sc)
  heap = sc._jvm.java.lang.Runtime.getRuntime().maxMemory()
  facts = bench_run.machine_facts(sc)
  print('Machine:', json.dumps(facts))
  print('Caps:', json.dumps(conf), f'(JVM max heap {heap / 2**20:.0f} MiB)')
  print(f'Hot key: {hot_count} values of {value_bytes} bytes = '
        f'{expected_hot[1] / GIB:.2f} GiB, from {args.shards} shards; '
        f'{args.cold_keys} small keys of {args.shards} values', flush=True)
  results = []
  for variant in args.variants.split(','):
    out_dir = os.path.join(args.out, 'runs', 'large_key', variant)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    output = os.path.join(out_dir, 'out')
    before = rest.last_job_id()
    timer = threading.Timer(args.timeout, sc.cancelAllJobs)
    timer.daemon = True
    result = {'variant': variant}
    start = time.perf_counter()
    pool = (workloads.handwritten_pool(sc)
            if variant.startswith('pyspark') else contextlib.nullcontext())
    with MemoryWatch() as watch, pool:
      timer.start()
      try:
        VARIANTS[variant](sc, args.shards, gen, output)
        result['outcome'] = 'done'
      except Exception as exn:  # pylint: disable=broad-except
        result['outcome'] = 'failed'
        result['error'] = error_summary(exn)
        result['traceback_tail'] = traceback.format_exc()[-3000:]
      finally:
        timer.cancel()
    result['seconds'] = time.perf_counter() - start
    if result['seconds'] >= args.timeout:
      result['outcome'] = f'cancelled after {args.timeout:.0f}s'
    result['peak_jvm_rss_mib'] = watch.peak_jvm / 2**20
    result['peak_python_worker_rss_mib'] = watch.peak_worker / 2**20
    result.update(spill_totals(rest, before))
    if result['outcome'] == 'done':
      lines = read_output(output)
      result['output'] = lines
      hot = [l for l in lines if l.startswith(records.HOT_KEY + '\t')]
      got = tuple(int(x) for x in hot[0].split('\t')[1:3]) if hot else None
      result['correct'] = got == expected_hot and len(lines) == 1 + args.cold_keys
    results.append(result)
    print(f'\n{variant}: {result["outcome"]} in {result["seconds"]:.0f}s; peak RSS '
          f'JVM {result["peak_jvm_rss_mib"]:.0f} MiB, largest Python worker '
          f'{result["peak_python_worker_rss_mib"]:.0f} MiB; spilled '
          f'{result["memory_spilled_mib"]:.0f} MiB (memory) / '
          f'{result["disk_spilled_mib"]:.0f} MiB (disk); shuffle write '
          f'{result["shuffle_write_mib"]:.0f} MiB; failed tasks '
          f'{result["failed_tasks"]}', flush=True)
    if 'correct' in result:
      print(f'  output {"correct" if result["correct"] else "WRONG"}: '
            f'{result["output"][:1]}')
    if 'error' in result:
      print('  ' + result['error'].replace('\n', '\n  '))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f'large_key-{time.strftime("%Y%m%d-%H%M%S")}.json')
  with open(path, 'w') as f:
    json.dump({'machine': facts, 'caps': conf, 'jvm_max_heap_mib': heap / 2**20,
               'args': vars(args), 'results': results}, f, indent=1)
  print(f'\nReport: {path}')
  sys.exit(0 if all(r['outcome'] == 'done' for r in results) else 1)


if __name__ == '__main__':
  main()
