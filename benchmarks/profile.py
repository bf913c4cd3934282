"""Where the time of one workload goes, on our runner and hand-written.

    python -m benchmarks.profile [--workload wordcount] [--size-mb 50]
                                 [--py-spy PATH]

One process, one SparkContext (local[2], the settings of benchmarks.run).
After a warm-up over a small input, the workload runs once per variant
while three observers record it:

* the driver: pipeline -> proto -> plan is timed directly (the same calls
  the runner makes), the rest of the run from outside;
* Spark: each job, stage and task through the UI's REST API (wall times,
  executor run/CPU/GC/deserialize time, shuffle bytes, write time and fetch
  wait);
* the Python workers: py-spy (``pip install py-spy``) samples the
  PySpark daemon and every worker it forks; each sample is put in one
  bucket by the innermost frame that names a bucket (see ``BUCKETS``), so
  the buckets add up to the workers' busy CPU time.  Workers waiting on
  their socket are idle and not sampled.

Prints a report and writes it, with the raw samples, under OUT/profile/.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from datetime import timezone
from typing import Optional

from benchmarks import corpus
from benchmarks import probe
from benchmarks import run as bench_run
from benchmarks import workloads as wl

# (bucket, predicate on (function, file)); the innermost frame that matches
# one of these decides a sample's bucket.  Set-up and imports are checked
# first over the whole stack: their inner frames are ordinary Beam code.
WHOLE_STACK_BUCKETS = [
    ('imports (first use of a module in a worker)',
     lambda fn, path: fn == '_find_and_load' and 'importlib' in path),
    ('harness set-up (runtime, descriptor, DoFns)',
     lambda fn, path: (fn in ('acquire', 'for_stage', 'job_runtime') and
                       'beam_pyspark/worker' in path) or
     (fn == 'get' and path.endswith('sdk_worker.py'))),
]
BUCKETS = [
    ('user functions (benchmarks/records.py)',
     lambda fn, path: path.endswith('benchmarks/records.py')),
    ('Beam text read/write (apache_beam/io)',
     lambda fn, path: '/apache_beam/io/' in path),
    ('runner: map-side keying/encode (worker/elements.py, spark/tasks.py)',
     lambda fn, path: path.endswith(('beam_pyspark/worker/elements.py',
                                     'beam_pyspark/spark/tasks.py'))),
    ('runner: reduce-side grouping (worker/shuffle/grouping.py)',
     lambda fn, path: path.endswith('beam_pyspark/worker/shuffle/grouping.py')),
    ('runner: bundle loop (worker/bundles.py, harnesses/)',
     lambda fn, path: '/beam_pyspark/worker/' in path),
    ('Beam harness per element (operations, DoFn and combine runners, coders)',
     lambda fn, path: '/apache_beam/' in path),
    ('PySpark pickling of shuffled/collected records',
     lambda fn, path: fn.startswith(('CloudPickleSerializer.', 'CPickleSerializer.',
                                     'Pickler.', 'dumps', 'loads'))),
    ('PySpark Python-side shuffle (partition hash, batching, groupByKey merge)',
     lambda fn, path: path.endswith(('pyspark/shuffle.py', 'pyspark/rdd.py'))),
    ('PySpark framing and text decoding to/from the JVM',
     lambda fn, path: '/pyspark/' in path),
]
# PySpark's daemon runs gc.collect() after every task of a reused worker; a
# sample whose innermost Python frame is the daemon's loop is that.
DAEMON_GC = 'PySpark daemon: gc.collect() after each task'
OTHER = 'other'


def classify(frames: list[tuple[str, str]]) -> str:
  """``frames`` root first, as py-spy writes them."""
  if frames and frames[-1][0] == 'manager' and frames[-1][1].endswith('daemon.py'):
    return DAEMON_GC
  for bucket, matches in WHOLE_STACK_BUCKETS:
    if any(matches(fn, path) for fn, path in frames):
      return bucket
  for fn, path in reversed(frames):
    for bucket, matches in BUCKETS:
      if matches(fn, path):
        return bucket
  return OTHER


def parse_raw(path: str, commands: bool = False):
  """py-spy's raw (collapsed) format: ``frame;frame;... count`` per line.

  With --subprocesses a stack starts with one ``process PID:"cmd"`` frame
  per ancestor: the daemon, then (for a forked worker) the worker.
  Yields (pid chain, [(function, file)], count); with ``commands`` each
  pid of the chain is (pid, its command line).
  """
  with open(path, encoding='utf-8', errors='replace') as f:
    for line in f:
      line = line.rstrip('\n')
      if not line:
        continue
      stack, _, count = line.rpartition(' ')
      if not count.isdigit():  # not a stack (py-spy's notes)
        continue
      parts = stack.split(';')
      pids = []
      while parts and parts[0].startswith('process '):
        pid, _, cmd = parts.pop(0)[len('process '):].partition(':')
        pids.append((pid, cmd) if commands else pid)
      frames = []
      for part in parts:
        # "function (file:line)" or "function (file)"
        fn, _, rest = part.partition(' (')
        frames.append((fn, rest.rstrip(')').rsplit(':', 1)[0]))
      yield tuple(pids), frames, int(count)


class PySpy:
  """py-spy recording a process and its forked children."""
  def __init__(
      self, exe: str, pid: int, output: str, rate: int, native: bool = False):
    self.output = output
    self.rate = rate
    self.proc = subprocess.Popen(
        [exe, 'record', '--pid', str(pid), '--subprocesses', '--rate',
         str(rate), '--format', 'raw', '--full-filenames', '--output', output
        ] + (['--native'] if native else ['--nonblocking']),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attach before the work starts

  def stop(self) -> None:
    self.proc.send_signal(signal.SIGINT)
    try:
      _, err = self.proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      _, err = self.proc.communicate()
    if not os.path.exists(self.output):
      raise RuntimeError(f'py-spy wrote nothing: {err.decode()[-2000:]}')

  def buckets(self) -> dict:
    seconds = collections.Counter()
    self_time = collections.Counter()
    per_process = collections.Counter()
    daemon_s = 0.0
    for pids, frames, count in parse_raw(self.output):
      if len(pids) < 2:
        # The daemon itself: its accept loop, which py-spy cannot always
        # tell idle; no task work happens there.
        daemon_s += count / self.rate
        continue
      per_process[pids[-1]] += count / self.rate
      seconds[classify(frames)] += count / self.rate
      if frames:
        fn, path = frames[-1]
        self_time[f'{fn} ({short(path)})'] += count / self.rate
    return {
        'processes': dict(per_process),
        'daemon_loop_s': daemon_s,
        'buckets': dict(seconds.most_common()),
        'top_self': dict(self_time.most_common(25)),
    }


def short(path: str) -> str:
  for marker in ('site-packages/', '/work/main/'):
    if marker in path:
      return path.split(marker, 1)[1]
  return path


def daemon_pid(pool: Optional[str]) -> Optional[int]:
  """The PySpark daemon of a worker pool (a child of this process's JVM).

  ``pool``: the value of benchmarks.workloads.POOL_VARIABLE in its
  environment, None for the runner's pool.
  """
  import psutil
  me = psutil.Process()
  for child in me.children(recursive=True):
    try:
      cmd = child.cmdline()
      env = child.environ()
    except psutil.Error:
      continue
    if (any('pyspark.daemon' in c for c in cmd) and
        env.get(wl.POOL_VARIABLE) == pool and child.parent().name() == 'java'):
      return child.pid
  return None


class SparkRest:
  def __init__(self, sc):
    self.base = f'{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}'

  def get(self, path: str):
    with urllib.request.urlopen(f'{self.base}/{path}') as r:
      return json.load(r)

  def jobs_since(self, job_id: int) -> list[dict]:
    return sorted(
        (j for j in self.get('jobs') if j['jobId'] > job_id),
        key=lambda j: j['jobId'])

  def last_job_id(self) -> int:
    return max((j['jobId'] for j in self.get('jobs')), default=-1)


def ts(text: str) -> float:
  return datetime.strptime(text, '%Y-%m-%dT%H:%M:%S.%f%Z').replace(
      tzinfo=timezone.utc).timestamp()


def spark_summary(rest: SparkRest, jobs: list[dict]) -> dict:
  """Job and stage walls, task metrics summed, from the REST API."""
  out_jobs = []
  totals = collections.Counter()
  for job in jobs:
    if 'completionTime' not in job:
      # Still running: the runner releases a finished job's harnesses in
      # a Spark job of its own, in the background (spark.translate).
      continue
    wall = ts(job['completionTime']) - ts(job['submissionTime'])
    stages = []
    for stage_id in job['stageIds']:
      for s in rest.get(f'stages/{stage_id}'):
        if s['status'] != 'COMPLETE' or 'submissionTime' not in s:
          continue  # skipped: its shuffle output was reused
        tasks = rest.get(
            f'stages/{stage_id}/{s["attemptId"]}/taskList?length=100000')
        task_ms = sum(t.get('duration', 0) for t in tasks)
        sched = sum(t.get('schedulerDelay', 0) for t in tasks)
        m = {
            'stage': stage_id,
            'name': s['name'][:60],
            'tasks': s['numTasks'],
            'wall_s': ts(s['completionTime']) - ts(s['submissionTime']),
            'task_s': task_ms / 1000,
            'max_task_s': max((t.get('duration', 0) for t in tasks), default=0) / 1000,
            'run_s': s['executorRunTime'] / 1000,
            'jvm_cpu_s': s['executorCpuTime'] / 1e9,
            'deserialize_s': s['executorDeserializeTime'] / 1000,
            'gc_s': s['jvmGcTime'] / 1000,
            'scheduler_delay_s': sched / 1000,
            'shuffle_write_mb': s['shuffleWriteBytes'] / 2**20,
            'shuffle_write_s': s['shuffleWriteTime'] / 1e9,
            'shuffle_read_mb': s['shuffleReadBytes'] / 2**20,
            'shuffle_fetch_wait_s': s['shuffleFetchWaitTime'] / 1000,
            'spill_disk_mb': s['diskBytesSpilled'] / 2**20,
            'spill_mem_mb': s['memoryBytesSpilled'] / 2**20,
        }
        stages.append(m)
        for k, v in m.items():
          if k.endswith(('_s', '_mb')) and k not in ('max_task_s',):
            totals[k] += v
    out_jobs.append({
        'job': job['jobId'], 'name': job['name'][:60], 'wall_s': wall,
        'stages': stages
    })
  first = min((ts(j['submissionTime']) for j in jobs), default=0)
  last = max((ts(j['completionTime']) for j in jobs), default=0)
  return {
      'jobs': out_jobs,
      'totals': dict(totals),
      'job_walls_s': sum(j['wall_s'] for j in out_jobs),
      'first_submit': first,
      'last_complete': last,
  }


def time_planning(workload: wl.Workload, paths: dict, output: str) -> dict:
  """The driver's work before Spark sees anything, step by step."""
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions
  from apache_beam.runners.portability.fn_api_runner.fn_runner import (
      group_by_key_input_visitor)
  from apache_beam.transforms import environments
  from beam_pyspark.planning import check_supported
  from beam_pyspark.planning import plan_pipeline

  steps = {}
  t = time.perf_counter()
  p = beam.Pipeline(
      options=PipelineOptions(bench_run.our_flags(None)))
  workload.beam(p, paths, output)
  steps['build pipeline graph (user code, Beam)'] = time.perf_counter() - t
  t = time.perf_counter()
  p.visit(group_by_key_input_visitor(True))
  proto = p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default())
  steps['to_runner_api (pickle DoFns)'] = time.perf_counter() - t
  t = time.perf_counter()
  check_supported(proto)
  steps['validate'] = time.perf_counter() - t
  t = time.perf_counter()
  plan = plan_pipeline(proto)
  steps['plan (fusion phases, descriptors)'] = time.perf_counter() - t
  return {
      'steps_s': steps,
      'stages': [(s.name, s.kind, len(s.descriptor)) for s in plan.stages],
  }


def time_worker_setup(workload: wl.Workload, paths: dict, output: str) -> dict:
  """Cost of what a fresh Python worker does before its first element."""
  code = ('import time; t=time.perf_counter(); import apache_beam; '
          'from apache_beam.runners.worker import sdk_worker, bundle_processor; '
          'import beam_pyspark.worker.harnesses.embedded; '
          'print(time.perf_counter()-t)')
  times = []
  for _ in range(3):
    out = subprocess.run([sys.executable, '-c', code],
                         capture_output=True, text=True, check=True)
    times.append(float(out.stdout.strip().splitlines()[-1]))
  # Harness creation per stage, as a worker does once per (job, stage).
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions
  from apache_beam.transforms import environments
  from beam_pyspark.planning import plan_pipeline
  from apache_beam.portability.api import beam_fn_api_pb2
  from beam_pyspark.worker.harnesses.embedded import EmbeddedHarness
  from beam_pyspark.worker.runtime import JobRuntime
  p = beam.Pipeline(options=PipelineOptions(bench_run.our_flags(None)))
  workload.beam(p, paths, output)
  plan = plan_pipeline(p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default()))
  t = time.perf_counter()
  JobRuntime('setup-probe', plan.components)
  runtime_s = time.perf_counter() - t
  per_stage = {}
  for stage in plan.stages:
    if stage.kind != 'sdk':
      continue
    t = time.perf_counter()
    h = EmbeddedHarness(
        beam_fn_api_pb2.ProcessBundleDescriptor.FromString(stage.descriptor))
    # The bundle processor (DoFn unpickling, setup) is built on first use.
    h.processors.get('probe', h.descriptor.id)
    per_stage[stage.name] = time.perf_counter() - t
    h.shutdown()
  return {
      'import_beam_s': sorted(times)[1],
      'job_runtime_s': runtime_s,
      'harness_per_stage_s': per_stage,
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workload', default='wordcount', choices=list(wl.WORKLOADS))
  parser.add_argument('--size-mb', type=float, default=50)
  parser.add_argument('--variants', default='ours,pyspark')
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--spark-conf', action='append', default=[])
  parser.add_argument('--rate', type=int, default=100)
  parser.add_argument(
      '--native', action='store_true',
      help='py-spy --native: see inside Beam\'s Cython modules (slower)')
  parser.add_argument(
      '--py-spy', default=shutil.which('py-spy'),
      help='py-spy executable (pip install py-spy); without it, no worker '
      'profile')
  parser.add_argument('--out', default=os.path.join('out', 'bench'))
  parser.add_argument('--seed', type=int, default=corpus.DEFAULT_SEED)
  args = parser.parse_args(argv)
  corpus_dir = os.path.join(args.out, 'corpus')
  prof_dir = os.path.join(args.out, 'profile')
  os.makedirs(prof_dir, exist_ok=True)
  workload = wl.WORKLOADS[args.workload]
  paths = {
      role: corpus.ensure(corpus_dir, kind, args.size_mb, args.seed)
      for role, kind in workload.inputs.items()
  }
  warm_paths = {
      role: corpus.ensure(corpus_dir, kind, bench_run.WARMUP_MB, args.seed)
      for role, kind in workload.inputs.items()
  }
  conf = dict(pair.split('=', 1) for pair in args.spark_conf)
  session = bench_run.start_spark(args.master, conf)
  sc = session.sparkContext
  rest = SparkRest(sc)
  flags = bench_run.our_flags(None)
  scratch = os.path.join(args.out, 'runs', 'profile')
  report = {
      'workload': args.workload,
      'size_mb': args.size_mb,
      'machine': bench_run.machine_facts(sc),
  }
  report['planning'] = time_planning(workload, paths, os.path.join(scratch, 'x'))
  report['worker_setup'] = time_worker_setup(
      workload, paths, os.path.join(scratch, 'y'))

  def execute(variant: str, run_paths: dict):
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    output = os.path.join(scratch, 'out')
    start = time.time()
    if variant == 'pyspark':
      wl.run_pyspark(workload, sc, run_paths, output)
    else:
      wl.run_beam(workload, flags, run_paths, output)
    return start, time.time()

  variants = args.variants.split(',')
  # Cold: the first run of each variant in a fresh worker pool.
  for variant in variants:
    start, end = execute(variant, warm_paths)
    report.setdefault('cold_small_run_s', {})[variant] = end - start
  for variant in variants:
    daemon = daemon_pid('hand-written' if variant == 'pyspark' else None)
    spy = None
    if args.py_spy and daemon:
      raw = os.path.join(
          prof_dir, f'{args.workload}-{variant}-workers'
          f'{"-native" if args.native else ""}.txt')
      spy = PySpy(args.py_spy, daemon, raw, args.rate, args.native)
    before = rest.last_job_id()
    with bench_run.CpuMeter() as meter:
      start, end = execute(variant, paths)
    if spy:
      spy.stop()
    jobs = rest.jobs_since(before)
    spark = spark_summary(rest, jobs)
    spark['run_wall_s'] = end - start
    spark['driver_before_first_job_s'] = spark['first_submit'] - start
    spark['driver_after_last_job_s'] = end - spark['last_complete']
    spark['driver_between_jobs_s'] = (
        spark['last_complete'] - spark['first_submit'] - spark['job_walls_s'])
    # py-spy counts a runnable thread as busy even while another process
    # holds the CPU; on a loaded machine its seconds exceed the CPU time.
    entry = {'spark': spark, 'cpu_s': meter.seconds}
    if spy:
      entry['workers'] = spy.buckets()
    report[variant] = entry
  report['workers_after'] = probe.probe_workers(sc)
  with wl.handwritten_pool(sc):
    report['workers_after'] += probe.probe_workers(sc)
  path = os.path.join(prof_dir, f'{args.workload}-{args.size_mb:g}mb.json')
  with open(path, 'w') as f:
    json.dump(report, f, indent=1, default=str)
  print_report(report, variants)
  print(f'\nFull report: {path}')


def print_report(report: dict, variants: list[str]) -> None:
  print('\nPython workers after the runs:')
  for w in report.get('workers_after', ()):
    print('  ' + ', '.join(f'{k}={v:.3f}' if isinstance(v, float) else f'{k}={v}'
                          for k, v in w.items()))
  print(f'\n== {report["workload"]}, {report["size_mb"]:g} MiB ==')
  print('Driver planning (s):')
  for k, v in report['planning']['steps_s'].items():
    print(f'  {v:7.3f}  {k}')
  print(f'  {len(report["planning"]["stages"])} stages: ' + ', '.join(
      f'{n}({k})' for n, k, _ in report['planning']['stages']))
  ws = report['worker_setup']
  print(f'Worker set-up: import Beam+harness {ws["import_beam_s"]:.2f}s per '
        f'new Python worker; job runtime {ws["job_runtime_s"]:.3f}s; harness '
        'per stage ' + ', '.join(
            f'{k} {v:.3f}s' for k, v in ws['harness_per_stage_s'].items()))
  print('Cold small run (fresh workers): ' + ', '.join(
      f'{k} {v:.1f}s' for k, v in report['cold_small_run_s'].items()))
  for variant in variants:
    entry = report[variant]
    s = entry['spark']
    print(f'\n-- {variant}: {s["run_wall_s"]:.2f}s wall, {entry["cpu_s"]:.1f} CPU-s '
          '(all processes) --')
    print(f'  driver before first Spark job {s["driver_before_first_job_s"]:.2f}s, '
          f'between jobs {s["driver_between_jobs_s"]:.2f}s, after last '
          f'{s["driver_after_last_job_s"]:.2f}s; {len(s["jobs"])} jobs')
    for job in s['jobs']:
      print(f'  job {job["job"]} {job["wall_s"]:6.2f}s  {job["name"]}')
      for st in job['stages']:
        print(f'    stage {st["stage"]:3d} {st["tasks"]:3d} tasks wall '
              f'{st["wall_s"]:6.2f}s task-sum {st["task_s"]:6.2f}s max '
              f'{st["max_task_s"]:5.2f}s jvm-cpu {st["jvm_cpu_s"]:5.2f}s '
              f'gc {st["gc_s"]:4.2f}s sched {st["scheduler_delay_s"]:4.2f}s '
              f'shW {st["shuffle_write_mb"]:6.1f}MB/{st["shuffle_write_s"]:4.2f}s '
              f'shR {st["shuffle_read_mb"]:6.1f}MB wait '
              f'{st["shuffle_fetch_wait_s"]:4.2f}s spill {st["spill_disk_mb"]:.0f}MB'
              f'  {st["name"]}')
    if 'workers' in entry:
      w = entry['workers']
      total = sum(w['buckets'].values())
      print(f'  Python workers busy {total:.1f}s (py-spy samples; per worker: '
            + ', '.join(f'{v:.1f}s' for v in w['processes'].values()) +
            '); share, and that share of the run\'s CPU time:')
      for k, v in w['buckets'].items():
        share = v / max(total, 1e-9)
        print(f'    {100 * share:5.1f}%  {share * entry["cpu_s"]:6.1f} CPU-s  {k}')
      print('  top self time:')
      for k, v in list(w['top_self'].items())[:15]:
        print(f'    {v:7.2f}s  {k}')


if __name__ == '__main__':
  main()
