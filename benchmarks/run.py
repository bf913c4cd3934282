"""Run the benchmark workloads side by side and print times and ratios.

    python -m benchmarks.run [--size-mb 10] [--repeats 3] [--workloads ...]

Every workload runs three ways, in one process, on one SparkContext
(``--master``, local[2] by default):

* ``ours``     Beam on ``beam_pyspark.PySparkRunner`` (which reuses the
               active SparkContext);
* ``ours_harness``  the same with ``--no_fast_path``: every stage in Beam's
               SDK harness;
* ``pyspark``  the same work hand-written with PySpark's RDD API;
* ``direct``   Beam's DirectRunner (for batch, the FnApiRunner) with
               ``--direct_num_workers=2 --direct_running_mode=multi_processing``;
* ``direct_inmem``  the same in ``in_memory`` mode (one process; not run
               unless asked for with ``--variants``).

The ratio ours / DirectRunner is taken against the faster of the
DirectRunner variants that ran.

The time of a run is its pipeline time: from building the pipeline (or the
RDDs) to its last output file being written; the SparkContext is already
up.  Before the timed runs every variant runs once over a small input, so
that the JVM, the Python workers and their imports are warm for all of
them; those warm-up times are printed too.  Within a repeat the order of
the variants rotates, so a burst of load on a shared machine does not
always fall on the same one.  The outputs of every run are checked against
each other (an order-independent digest of their lines); a mismatch fails
the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

from benchmarks import corpus
from benchmarks import workloads as wl

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ('ours', 'ours_harness', 'pyspark', 'direct', 'direct_inmem')
DEFAULT_VARIANTS = ('ours', 'ours_harness', 'pyspark', 'direct')
DIRECT_MODES = {'direct': 'multi_processing', 'direct_inmem': 'in_memory'}
WARMUP_MB = 0.5

# What the runner itself sets when it starts Spark (beam_pyspark/spark/
# session.py), so the hand-written jobs run under the same settings; its
# daemon (Beam imported before forking) in every pool but the hand-written
# jobs' (benchmarks/daemon.py).
RUNNER_DEFAULT_CONF = {
    'spark.ui.showConsoleProgress': 'false',
    'spark.python.worker.reuse': 'true',
    'spark.python.daemon.module': 'benchmarks.daemon',
}


@dataclasses.dataclass
class Run:
  workload: str
  variant: str
  size_mb: float
  repeat: int  # -1: warm-up
  seconds: float
  digest: str
  # CPU seconds of this process and all its descendants (the JVM, Python
  # workers, DirectRunner workers) during the run: less disturbed than wall
  # time by other load on a shared machine.
  cpu_seconds: float = 0.0
  load_avg: float = 0.0  # the machine's 1-minute load average at the end


class CpuMeter:
  """User+system CPU seconds of this process and its descendants over a run.

  Descendants are sampled every ``interval`` seconds and each is counted from
  its first to its last sample, so processes that start or exit during the
  run (DirectRunner workers, forked Python workers) count too, give or take
  one interval each; processes alive before the run count only their CPU
  during it.
  """
  def __init__(self, interval: float = 0.2):
    import psutil
    self._psutil = psutil
    self._me = psutil.Process()
    self.interval = interval
    self._first: dict[int, float] = {}
    self._last: dict[int, float] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def _own(self) -> float:
    t = self._me.cpu_times()
    return t.user + t.system

  def _sample(self) -> None:
    for p in self._me.children(recursive=True):
      try:
        if p.name() == 'py-spy':  # benchmarks.profile's sampler
          continue
        t = p.cpu_times()
      except self._psutil.Error:
        continue
      self._first.setdefault(p.pid, t.user + t.system)
      self._last[p.pid] = t.user + t.system

  def _loop(self) -> None:
    while not self._stop.wait(self.interval):
      self._sample()

  def __enter__(self):
    self._sample()
    self._own_start = self._own()
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self._sample()
    self.seconds = self._own() - self._own_start + sum(
        self._last[pid] - self._first[pid] for pid in self._last)


def direct_flags(mode: str, workers: int) -> list[str]:
  return [
      '--runner=DirectRunner', f'--direct_num_workers={workers}',
      f'--direct_running_mode={mode}',
      # Its workers would otherwise log every bundle's set-up at INFO.
      '--default_sdk_harness_log_level=WARNING',
  ]


def our_flags(parallelism: Optional[int]) -> list[str]:
  flags = ['--runner=beam_pyspark.PySparkRunner']
  if parallelism:
    flags.append(f'--spark_parallelism={parallelism}')
  return flags


def start_spark(master: str, conf: dict):
  """The one SparkContext of the process, with the runner's settings."""
  from pyspark.sql import SparkSession
  os.environ['PYSPARK_PYTHON'] = sys.executable
  os.environ['PYSPARK_DRIVER_PYTHON'] = sys.executable
  # Executors and DirectRunner workers unpickle functions of
  # benchmarks.workloads by reference.
  paths = [REPO_ROOT] + [
      p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
  os.environ['PYTHONPATH'] = os.pathsep.join(dict.fromkeys(paths))
  settings = dict(RUNNER_DEFAULT_CONF)
  settings['spark.executorEnv.PYTHONPATH'] = os.pathsep.join(
      dict.fromkeys([REPO_ROOT] + [p for p in sys.path if p and os.path.isdir(p)]))
  settings.update(conf)
  builder = SparkSession.builder.master(master).appName('beam-pyspark-bench')
  for key, value in settings.items():
    builder = builder.config(key, value)
  session = builder.getOrCreate()
  session.sparkContext.setLogLevel('WARN')
  return session


def machine_facts(sc) -> dict:
  import apache_beam
  import pyspark

  def java_version():
    try:
      out = subprocess.run(['java', '-version'], capture_output=True, text=True)
      return (out.stderr or out.stdout).splitlines()[0]
    except (OSError, IndexError):
      return 'unknown'

  mem_kb = 0
  with open('/proc/meminfo') as f:
    for line in f:
      if line.startswith('MemTotal:'):
        mem_kb = int(line.split()[1])
  cpu = platform.processor() or ''
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          cpu = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  return {
      'nproc': os.cpu_count(),
      'cpu': cpu,
      'ram_gib': round(mem_kb / (1 << 20), 1),
      'python': platform.python_version(),
      'java': java_version(),
      'spark': pyspark.__version__,
      'beam': apache_beam.__version__,
      'master': sc.master,
      'load_avg_at_start': os.getloadavg(),
      'commit': git_commit(),
  }


def git_commit() -> str:
  try:
    out = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    dirty = subprocess.run(['git', 'status', '--porcelain', 'beam_pyspark'],
                           cwd=REPO_ROOT, capture_output=True, text=True)
    return out.stdout.strip() + ('+uncommitted engine changes' if dirty.stdout.strip() else '')
  except OSError:
    return 'unknown'


class Bench:
  def __init__(self, args, sc):
    self.args = args
    self.sc = sc
    self.runs: list[Run] = []
    self.flags = {
        'ours': our_flags(args.spark_parallelism),
        'ours_harness': our_flags(args.spark_parallelism) + ['--no_fast_path'],
        **{
            variant: direct_flags(mode, args.direct_workers)
            for variant, mode in DIRECT_MODES.items()
        }
    }

  def inputs(self, workload: wl.Workload, size_mb: float) -> dict:
    return {
        role: corpus.ensure(self.args.corpus_dir, kind, size_mb, self.args.seed)
        for role, kind in workload.inputs.items()
    }

  def run_once(
      self, workload: wl.Workload, variant: str, paths: dict, size_mb: float,
      repeat: int) -> Run:
    out_dir = os.path.join(self.args.out, 'runs', workload.name, variant)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    output = os.path.join(out_dir, 'out')
    # Our job's release of its harnesses (a Spark job from a thread) is
    # ours: waited for in our meter, after the wall time; never in another's.
    from beam_pyspark.spark import release  # pylint: disable=import-outside-toplevel
    release.wait_for_releases(60.0)
    with CpuMeter() as meter:
      start = time.perf_counter()
      if variant == 'pyspark':
        wl.run_pyspark(workload, self.sc, paths, output)
      else:
        wl.run_beam(workload, self.flags[variant], paths, output)
      seconds = time.perf_counter() - start
      release.wait_for_releases(60.0)
    cpu = meter.seconds
    run = Run(
        workload.name, variant, size_mb, repeat, seconds,
        str(wl.digest(output)), cpu, os.getloadavg()[0])
    self.runs.append(run)
    return run

  def workload(self, workload: wl.Workload, variants: list[str]) -> None:
    args = self.args
    if not args.no_warmup:
      paths = self.inputs(workload, WARMUP_MB)
      for variant in variants:
        run = self.run_once(workload, variant, paths, WARMUP_MB, -1)
        print(f'  warm-up {workload.name:15s} {variant:12s} '
              f'{run.seconds:7.2f}s {run.cpu_seconds:7.1f} CPU-s  '
              f'load {run.load_avg:4.1f}  {run.digest}', flush=True)
      self.check(workload.name, -1)
    paths = self.inputs(workload, args.size_mb)
    for repeat in range(args.repeats):
      k = repeat % len(variants)
      for variant in variants[k:] + variants[:k]:
        run = self.run_once(workload, variant, paths, args.size_mb, repeat)
        print(f'  run {repeat + 1}/{args.repeats} {workload.name:15s} '
              f'{variant:12s} {run.seconds:7.2f}s {run.cpu_seconds:7.1f} CPU-s  '
              f'load {run.load_avg:4.1f}  {run.digest}', flush=True)
      self.check(workload.name, repeat)

  def check(self, workload: str, repeat: int) -> None:
    digests = {
        r.variant: r.digest
        for r in self.runs
        if r.workload == workload and r.repeat == repeat
    }
    if len(set(digests.values())) > 1:
      raise SystemExit(
          f'{workload}: the variants disagree on the output: {digests}')

  def medians(self, field: str = 'seconds') -> dict:
    table = {}
    for r in self.runs:
      if r.repeat >= 0:
        table.setdefault(r.workload, {}).setdefault(r.variant, []).append(
            getattr(r, field))
    return {
        w: {v: statistics.median(times) for v, times in by_variant.items()}
        for w, by_variant in table.items()
    }


def format_table(medians: dict, unit: str = 's') -> str:
  """A Markdown table: the median per variant and the ratios."""
  directs = [v for v in DIRECT_MODES if any(v in m for m in medians.values())]
  harness = any('ours_harness' in m for m in medians.values())
  head = ['workload', f'ours ({unit})'] + (
      [f'ours, harness only ({unit})'] if harness else []) + [
          f'PySpark ({unit})'] + [
      f'Direct {DIRECT_MODES[v]} ({unit})' for v in directs
  ] + ['ours / PySpark'] + (
      ['harness only / PySpark'] if harness else []) + ['ours / Direct']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]

  def cell(x):
    return '-' if x is None else f'{x:.1f}'

  def ratio(a, b):
    return '-' if a is None or b is None else f'{a / b:.2f}x'

  for name, m in medians.items():
    direct_times = [m[v] for v in directs if v in m]
    best_direct = min(direct_times) if direct_times else None
    row = [name, cell(m.get('ours'))]
    row += [cell(m.get('ours_harness'))] if harness else []
    row += [cell(m.get('pyspark'))]
    row += [cell(m.get(v)) for v in directs]
    row += [ratio(m.get('ours'), m.get('pyspark'))]
    row += [ratio(m.get('ours_harness'), m.get('pyspark'))] if harness else []
    row += [ratio(m.get('ours'), best_direct)]
    lines.append('| ' + ' | '.join(row) + ' |')
  return '\n'.join(lines)


def report(bench: 'Bench') -> str:
  args = bench.args
  parts = [
      f'Input: {args.size_mb:g} MiB per workload; medians of {args.repeats} '
      'runs.', '', 'Pipeline time (wall):', '',
      format_table(bench.medians('seconds'), 's'), '',
      'CPU time of all processes (driver, JVM, Python workers):', '',
      format_table(bench.medians('cpu_seconds'), 'CPU-s')
  ]
  if sum(v in DIRECT_MODES for v in args.variants.split(',')) > 1:
    parts += ['', 'ours / Direct is against the faster DirectRunner mode.']
  return '\n'.join(parts)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      description='Beam on beam_pyspark vs hand-written PySpark vs DirectRunner.')
  parser.add_argument(
      '--size-mb', type=float, default=10,
      help='MiB of main input per workload (default 10)')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument(
      '--workloads', default=','.join(wl.WORKLOADS),
      help='comma-separated, of: ' + ', '.join(wl.WORKLOADS))
  parser.add_argument(
      '--variants', default=','.join(DEFAULT_VARIANTS),
      help='comma-separated, of: ' + ', '.join(VARIANTS))
  parser.add_argument('--master', default='local[2]')
  parser.add_argument(
      '--spark-conf', action='append', default=[], metavar='KEY=VALUE',
      help='a Spark setting for the shared SparkContext; repeatable')
  parser.add_argument(
      '--spark-parallelism', type=int, default=None,
      help='--spark_parallelism for our runner (default: its own)')
  parser.add_argument('--direct-workers', type=int, default=2)
  parser.add_argument('--seed', type=int, default=corpus.DEFAULT_SEED)
  parser.add_argument('--out', default=os.path.join('out', 'bench'))
  parser.add_argument('--corpus-dir', default=None,
                      help='default: OUT/corpus (inputs are cached there)')
  parser.add_argument('--no-warmup', action='store_true')
  parser.add_argument(
      '--freeze-workers', action='store_true',
      help='experiment: gc.freeze() the runner\'s Python workers after '
      'importing Beam, before the runs (see benchmarks/probe.py)')
  args = parser.parse_args(argv)
  args.corpus_dir = args.corpus_dir or os.path.join(args.out, 'corpus')
  names = [n for n in args.workloads.split(',') if n]
  unknown = [n for n in names if n not in wl.WORKLOADS]
  variants = [v for v in args.variants.split(',') if v]
  if unknown or any(v not in VARIANTS for v in variants):
    parser.error(f'unknown workload or variant in {names} {variants}')

  logging.basicConfig(level=logging.WARNING)
  conf = dict(pair.split('=', 1) for pair in args.spark_conf)
  session = start_spark(args.master, conf)
  sc = session.sparkContext
  facts = machine_facts(sc)
  print('Machine:', json.dumps(facts))
  print(f'Spark conf: {json.dumps({**RUNNER_DEFAULT_CONF, **conf})}')
  bench = Bench(args, sc)
  if args.freeze_workers:
    from benchmarks import probe
    print('Froze the runner\'s Python workers (pid: frozen objects):',
          probe.freeze_workers(sc))
  for variant in variants:
    if variant in DIRECT_MODES:
      print(f'{variant}: {" ".join(bench.flags[variant])}')
  started = time.monotonic()
  for name in names:
    workload = wl.WORKLOADS[name]
    print(f'{name}: {workload.description}', flush=True)
    bench.workload(workload, variants)
  medians = bench.medians()
  table = report(bench)
  print()
  print(table)
  print(f'\nTotal {time.monotonic() - started:.0f}s; outputs of all variants agreed.')
  os.makedirs(args.out, exist_ok=True)
  stamp = time.strftime('%Y%m%d-%H%M%S')
  result_path = os.path.join(args.out, f'results-{stamp}.json')
  with open(result_path, 'w') as f:
    json.dump({
        'machine': facts,
        'args': vars(args),
        'runs': [dataclasses.asdict(r) for r in bench.runs],
        'medians': medians,
        'cpu_medians': bench.medians('cpu_seconds'),
        'table': table,
    }, f, indent=1)
  print(f'Raw times: {result_path}')


if __name__ == '__main__':
  main()
