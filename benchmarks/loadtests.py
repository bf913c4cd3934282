"""Beam's load tests as a benchmark: this runner, the DirectRunner and
hand-written PySpark side by side.

    python -m benchmarks.loadtests [--scale 1] [--repeats 3] [--tests ...]

Each test is one of Beam's own (``apache_beam.testing.load_tests``: its
``ParDoTest``, ``GroupByKeyTest``, ``CombineTest``, ``CoGroupByKeyTest``,
``SideInputTest`` classes, unchanged, reading Beam's ``SyntheticSource``),
with the options of one of Beam's configurations
(``.github/workflows/load-tests-pipeline-options/python_*``) at a size
that fits two cores shared with others (``TESTS``, times ``--scale``:
0.5-1 M records, where Beam's own run 200 M records of 10 bytes or 20 M
of 100). It runs, in one process on one
``local[2]`` SparkContext, alternating from repeat to repeat:

* ``ours``     the test on ``beam_pyspark.PySparkRunner``;
* ``pyspark``  the same work hand-written (``benchmarks.synthetic``: the
               same records, made by the same generator);
* ``direct``   the test on Beam's DirectRunner with
               ``--direct_num_workers=2 --direct_running_mode=multi_processing``.

A run's time is the test's ``run()`` (building the pipeline to its end),
or the hand-written job's; CPU time is that of every process (``run``'s
``CpuMeter``). The load tests write no output, so only their success is
checked; the hand-written jobs' equivalence is argued in their module.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import shlex
import statistics
import sys
import time
from typing import Optional

from benchmarks import run as bench
from benchmarks import synthetic
from benchmarks.workloads import handwritten_pool
from beam_pyspark.spark import release

VARIANTS = ('ours', 'pyspark', 'direct')


@dataclasses.dataclass(frozen=True)
class LoadTest:
  name: str
  module: str  # in apache_beam.testing.load_tests
  cls: str
  job: str  # in benchmarks.synthetic.JOBS
  options: dict  # the test's options (input sizes at scale 1)
  beams: str  # Beam's configuration it follows

  @staticmethod
  def source_spec(options: dict) -> dict:
    """A SyntheticSource's spec from input options, as
    LoadTest.parse_synthetic_source_options makes it."""
    return {
        'numRecords': options.get('num_records'),
        'keySizeBytes': options.get('key_size'),
        'valueSizeBytes': options.get('value_size'),
        'hotKeyFraction': options.get('hot_key_fraction', 0),
        'numHotKeys': options.get('num_hot_keys', 0),
    }


def _input(records: int, key: int, value: int, **more) -> dict:
  return dict(num_records=records, key_size=key, value_size=value, **more)


TESTS = {
    t.name: t for t in [
        LoadTest('pardo_10_iterations', 'pardo_test', 'ParDoTest', 'pardo', {
            'iterations': 10, 'number_of_counters': 0,
            'number_of_counter_operations': 0,
            'input_options': _input(500_000, 10, 90)},
                 'python_ParDo_*_Batch_10_Iterations (20 M records)'),
        LoadTest('pardo_10_counters', 'pardo_test', 'ParDoTest', 'pardo', {
            'iterations': 1, 'number_of_counters': 1,
            'number_of_counter_operations': 10,
            'input_options': _input(500_000, 10, 90)},
                 'python_ParDo_*_Batch_10_Counters (20 M records)'),
        LoadTest('gbk_10b', 'group_by_key_test', 'GroupByKeyTest',
                 'group_by_key', {
                     'iterations': 1, 'fanout': 1,
                     'input_options': _input(1_000_000, 1, 9)},
                 'python_GBK_*_Batch_2GB_of_10B_records (200 M records)'),
        LoadTest('combine_10b', 'combine_test', 'CombineTest', 'combine', {
            'top_count': 20, 'fanout': 1,
            'input_options': _input(1_000_000, 1, 9)},
                 'python_Combine_*_Batch_2GB_10_byte_records (200 M records)'),
        LoadTest('cogbk_multiple_keys', 'co_group_by_key_test',
                 'CoGroupByKeyTest', 'co_group_by_key', {
                     'iterations': 1,
                     'input_options': _input(500_000, 10, 90, num_hot_keys=5,
                                             hot_key_fraction=1),
                     'co_input_options': _input(
                         50_000, 10, 90, num_hot_keys=1000,
                         hot_key_fraction=1)},
                 'python_CoGBK_*_Batch_100b_Multiple_Keys (20 M + 2 M)'),
        LoadTest('sideinput_dict_1pct', 'sideinput_test', 'SideInputTest',
                 'side_input', {
                     'side_input_type': 'dict', 'access_percentage': 1,
                     'window_count': 1,
                     'input_options': _input(500_000, 10, 90)},
                 'python_SideInput_*_Batch dict, 1% accessed'),
    ]
}


def _scaled(options: dict, scale: float) -> dict:
  out = dict(options)
  for key in ('input_options', 'co_input_options'):
    if key in out:
      spec = dict(out[key])
      spec['num_records'] = max(1000, int(spec['num_records'] * scale))
      out[key] = spec
  return out


def _flags(options: dict) -> list[str]:
  flags = []
  for key, value in options.items():
    if isinstance(value, dict):
      value = json.dumps(value)
    flags.append(f'--{key}={value}')
  return flags


class RunnerEntry:
  """When Beam's test code first hands a pipeline to its runner (the
  runner's ``run_pipeline``): what comes before is the test's own work
  (``LoadTest.__init__``'s options and metrics set-up, building the
  pipeline, and ``TestPipeline.run``'s round trip through the runner
  API, which it forces for every runner), the same on any runner.
  Measured, not subtracted from a run's time: the table reports it
  beside it."""
  def __init__(self):
    self.at: Optional[float] = None
    self._run_internal = None

  def __enter__(self):
    from apache_beam import pipeline  # pylint: disable=import-outside-toplevel
    self.at = None
    original = self._run_internal = pipeline.Pipeline._run_internal
    entry = self

    def run_internal(pipe, *args, **kwargs):
      runner = pipe.runner
      if 'run_pipeline' not in vars(runner):
        hand_over = runner.run_pipeline

        def run_pipeline(*a, **k):
          if entry.at is None:
            entry.at = time.perf_counter()
          return hand_over(*a, **k)

        runner.run_pipeline = run_pipeline
      return original(pipe, *args, **kwargs)

    pipeline.Pipeline._run_internal = run_internal
    return self

  def __exit__(self, *_):
    from apache_beam import pipeline  # pylint: disable=import-outside-toplevel
    pipeline.Pipeline._run_internal = self._run_internal


def run_load_test(test: LoadTest, options: dict, runner_flags: list):
  """Beam's test class, as its module's ``__main__`` runs it: its
  options from ``--test-pipeline-options``. Returns the test (its
  ``result`` is the pipeline's)."""
  cls = getattr(importlib.import_module(
      f'apache_beam.testing.load_tests.{test.module}'), test.cls)
  argv = sys.argv
  sys.argv = [argv[0], '--test-pipeline-options=' + ' '.join(
      shlex.quote(f) for f in runner_flags + _flags(options))]
  try:
    instance = cls()
    instance.run()
  finally:
    sys.argv = argv
  return instance


def _import_runner(_) -> None:
  # What a task of the runner imports first (Beam among it); then a
  # moment, so that the tasks overlap and each takes a worker of its own
  # (one that ends at once hands its worker to the next task: at load 30
  # the second worker was then started, Beam imported, in a timed run).
  import beam_pyspark.spark.tasks  # pylint: disable=import-outside-toplevel,unused-import
  time.sleep(0.5)


def warm_runner_workers(sc) -> None:
  """A Python worker per core in the runner's pool, Beam imported, before
  a timed run of ours (untimed). PySpark stops a Python worker idle for a
  minute, and the rotation leaves four runs between two of ours once a
  round; a warm-up over 1% of the records is one split, one task, one
  worker: a timed run then paid a new worker's import of Beam (4 CPU-s
  of the ParDo test's 6.6 at load 25, where warm it took 2.4-2.7 against
  the hand-written 2.3-2.7). The hand-written pool's workers import
  nothing and stay warm; worker start-up is the fixed cost docs/benchmarks.md
  measures apart (benchmarks.fixed_cost). Since the benchmarks' context
  forks the runner's workers from the runner's own daemon (Beam imported
  before the fork: benchmarks/daemon.py), a new worker costs a fork, and
  this only keeps the pool as a run of the runner finds it."""
  n = max(1, sc.defaultParallelism)
  sc.parallelize(range(n), n).foreach(_import_runner)


class Bench:
  def __init__(self, args, sc):
    self.args = args
    self.sc = sc
    self.runs: list[bench.Run] = []
    # (test, variant) -> (seconds of Beam's test code before its runner
    # was called (RunnerEntry), the run's seconds), per timed run.
    self.before_runner: dict = {}
    self.flags = {
        'ours': bench.our_flags(args.spark_parallelism),
        'direct': bench.direct_flags('multi_processing', args.direct_workers),
    }

  def once(self, test: LoadTest, variant: str, options: dict, repeat: int,
           size: float) -> bench.Run:
    # A run of ours ends with the release of its harnesses (a Spark job
    # from a thread, when its workers hold any): its CPU is ours, so it is
    # waited for inside our meter (after our wall time is taken), and never
    # runs inside another variant's.
    release.wait_for_releases(60.0)
    if variant == 'ours':
      warm_runner_workers(self.sc)
    entry = RunnerEntry()
    with bench.CpuMeter() as meter:
      start = time.perf_counter()
      if variant == 'pyspark':
        with handwritten_pool(self.sc):
          synthetic.JOBS[test.job](self.sc, options)
      else:
        with entry:
          run_load_test(test, options, self.flags[variant])
      seconds = time.perf_counter() - start
      if entry.at is not None and repeat >= 0:
        self.before_runner.setdefault((test.name, variant), []).append(
            (entry.at - start, seconds))
      release.wait_for_releases(60.0)
    run = bench.Run(test.name, variant, size, repeat, seconds, 'ok',
                    meter.seconds, os.getloadavg()[0])
    self.runs.append(run)
    print(f'  {"warm-up" if repeat < 0 else f"run {repeat + 1}"} '
          f'{test.name:22s} {variant:8s} {run.seconds:7.2f}s '
          f'{run.cpu_seconds:7.1f} CPU-s  load {run.load_avg:4.1f}',
          flush=True)
    return run

  def test(self, test: LoadTest, variants: list[str]) -> None:
    if not self.args.no_warmup:
      small = _scaled(test.options, 0.01)
      for variant in variants:
        self.once(test, variant, small, -1, 0.01)
    options = _scaled(test.options, self.args.scale)
    for repeat in range(self.args.repeats):
      k = repeat % len(variants)
      for variant in variants[k:] + variants[:k]:
        self.once(test, variant, options, repeat, self.args.scale)

  def medians(self, field: str) -> dict:
    table: dict = {}
    for r in self.runs:
      if r.repeat >= 0:
        table.setdefault(r.workload, {}).setdefault(r.variant, []).append(
            getattr(r, field))
    return {t: {v: statistics.median(x) for v, x in by.items()}
            for t, by in table.items()}


def format_table(medians: dict, unit: str, loads: dict) -> str:
  head = ['test', f'ours ({unit})', f'PySpark ({unit})',
          f'Direct ({unit})', 'ours / PySpark', 'ours / Direct', 'load']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]

  def cell(x):
    return '-' if x is None else f'{x:.1f}'

  def ratio(a, b):
    return '-' if a is None or b is None else f'{a / b:.2f}x'

  for name, m in medians.items():
    lo, hi = loads.get(name, (0, 0))
    lines.append('| ' + ' | '.join([
        name, cell(m.get('ours')), cell(m.get('pyspark')),
        cell(m.get('direct')), ratio(m.get('ours'), m.get('pyspark')),
        ratio(m.get('ours'), m.get('direct')), f'{lo:.1f}-{hi:.1f}']) + ' |')
  return '\n'.join(lines)


def format_before_runner(before: dict, medians: dict) -> str:
  """Beam's test code before the runner is called, per Beam variant, and
  the rest of each run (medians over the runs, s), with that rest's ratio
  to hand-written PySpark's run: the runner's share (the hand-written
  job's time includes building its RDDs, a few ms)."""
  lines = ['| test | variant | Beam\'s test before the runner (s) | '
           'rest of the run (s) | rest / PySpark |', '|---|---|---|---|---|']
  for (name, variant), runs in before.items():
    b = statistics.median(x for x, _ in runs)
    rest = statistics.median(total - x for x, total in runs)
    hand = medians.get(name, {}).get('pyspark')
    lines.append(f'| {name} | {variant} | {b:.2f} | {rest:.2f} | '
                 f'{f"{rest / hand:.2f}x" if hand else "-"} |')
  return '\n'.join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tests', default=','.join(TESTS),
                      help='comma-separated, of: ' + ', '.join(TESTS))
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--scale', type=float, default=1.0,
                      help='times the records of TESTS (default 1)')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--spark-parallelism', type=int, default=None)
  parser.add_argument('--direct-workers', type=int, default=2)
  parser.add_argument('--no-warmup', action='store_true')
  parser.add_argument('--out', default=os.path.join('out', 'bench'))
  args = parser.parse_args(argv)
  names = [n for n in args.tests.split(',') if n]
  variants = [v for v in args.variants.split(',') if v]
  if any(n not in TESTS for n in names) or any(
      v not in VARIANTS for v in variants):
    parser.error(f'unknown test or variant in {names} {variants}')
  logging.basicConfig(level=logging.WARNING)
  session = bench.start_spark(args.master, {})
  sc = session.sparkContext
  facts = bench.machine_facts(sc)
  print('Machine:', json.dumps(facts))
  b = Bench(args, sc)
  for name in names:
    test = TESTS[name]
    print(f'{name}: Beam\'s {test.cls} as {test.beams}, scale {args.scale}',
          flush=True)
    b.test(test, variants)
  loads = {}
  for r in b.runs:
    if r.repeat >= 0:
      lo, hi = loads.get(r.workload, (r.load_avg, r.load_avg))
      loads[r.workload] = (min(lo, r.load_avg), max(hi, r.load_avg))
  wall = format_table(b.medians('seconds'), 's', loads)
  cpu = format_table(b.medians('cpu_seconds'), 'CPU-s', loads)
  before = format_before_runner(b.before_runner, b.medians('seconds'))
  print(f'\nMedians of {args.repeats}, wall:\n\n{wall}\n\nCPU:\n\n{cpu}'
        f'\n\n{before}')
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(
      args.out, f'loadtests-{time.strftime("%Y%m%d-%H%M%S")}.json')
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({'machine': facts, 'args': vars(args),
               'runs': [dataclasses.asdict(r) for r in b.runs],
               'before_runner': {f'{t}/{v}': x for (t, v), x in
                                 b.before_runner.items()},
               'wall': wall, 'cpu': cpu, 'before': before}, f, indent=1)
  print(f'Raw times: {path}')


if __name__ == '__main__':
  main()
