"""Where a workload's time goes on each engine: Spark's event logs.

    python -m benchmarks.connect_profile [--size-mb 20] [--workload groupbykey]
        [--repeats 1]

Runs the workload on the RDD engine (a local[2] SparkContext) and over
Spark Connect (tests/connect_server.py, local[2]), alternating, each
Spark writing an event log, after a small warm-up run of each. Prints
each run's wall time and the CPU seconds it cost each process tree (the
client, each JVM, its Python daemon and workers: CPU, unlike wall time,
barely moves with the machine's load), then, for each engine's first
measured run, the Spark jobs (their time, and the gaps between them: the
client's and the driver's work) and per Spark stage its tasks, wall
time, summed task run, JVM CPU and GC time, and shuffle bytes.

A tool to find what to cut, run by hand; the ratio lives in
benchmarks/connect.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import tempfile
import time

from benchmarks import corpus
from benchmarks import workloads as wl
from benchmarks.connect import REPO_ROOT
from benchmarks.connect import _flags
from benchmarks.connect import import_paths
from benchmarks.connect import run_and_exit

WARMUP_MB = 0.5


def _events(directory: str) -> list[dict]:
  """The events of the one application logged in ``directory`` (Spark 4
  rolls them: a directory of events_N_... files)."""
  (app,) = glob.glob(os.path.join(directory, '*'))
  paths = [app] if os.path.isfile(app) else sorted(
      glob.glob(os.path.join(app, 'events_*')),
      key=lambda p: int(os.path.basename(p).split('_')[1]))
  events = []
  for path in paths:
    with open(path, 'rb') as f:
      data = f.read()
    if path.endswith('.zstd'):
      import zstandard  # pylint: disable=import-outside-toplevel
      data = zstandard.ZstdDecompressor().stream_reader(data).read()
    events.extend(json.loads(line) for line in data.decode().splitlines()
                  if line.strip())
  return events


def summarize(events: list[dict], since_ms: float) -> list[str]:
  """Jobs and stages after ``since_ms`` (epoch ms)."""
  jobs, stages, tasks = {}, {}, {}
  for e in events:
    kind = e['Event']
    if kind == 'SparkListenerJobStart' and e['Submission Time'] >= since_ms:
      jobs[e['Job ID']] = {'start': e['Submission Time'],
                           'stages': e.get('Stage IDs', [])}
    elif kind == 'SparkListenerJobEnd' and e['Job ID'] in jobs:
      jobs[e['Job ID']]['end'] = e['Completion Time']
    elif kind == 'SparkListenerStageCompleted':
      info = e['Stage Info']
      if info.get('Submission Time', 0) >= since_ms:
        stages[info['Stage ID']] = info
    elif kind == 'SparkListenerTaskEnd':
      m = e.get('Task Metrics') or {}
      t = tasks.setdefault(e['Stage ID'], dict(
          run=0, cpu=0, ser=0, deser=0, gc=0, write=0, read=0, n=0,
          wtime=0, fetch=0, each=[]))
      t['n'] += 1
      t['run'] += m.get('Executor Run Time', 0)
      t['cpu'] += m.get('Executor CPU Time', 0) / 1e6
      t['ser'] += m.get('Result Serialization Time', 0)
      t['deser'] += m.get('Executor Deserialize Time', 0)
      t['gc'] += m.get('JVM GC Time', 0)
      w = m.get('Shuffle Write Metrics') or {}
      r = m.get('Shuffle Read Metrics') or {}
      t['write'] += w.get('Shuffle Bytes Written', 0)
      t['wtime'] += w.get('Shuffle Write Time', 0) / 1e6
      t['read'] += (r.get('Remote Bytes Read', 0) +
                    r.get('Local Bytes Read', 0))
      t['fetch'] += r.get('Fetch Wait Time', 0)
      t['each'].append((m.get('Executor Run Time', 0) / 1e3,
                        m.get('Executor CPU Time', 0) / 1e9,
                        (r.get('Local Bytes Read', 0) +
                         r.get('Remote Bytes Read', 0)) / 2**20))
  out = []
  previous_end = since_ms
  for job_id in sorted(jobs):
    job = jobs[job_id]
    end = job.get('end', job['start'])
    out.append(f'  job {job_id}: {(end - job["start"]) / 1e3:7.2f} s '
               f'(gap before it {(job["start"] - previous_end) / 1e3:6.2f} s)')
    previous_end = end
    for stage_id in job['stages']:
      info = stages.get(stage_id)
      if info is None:
        continue  # skipped (its shuffle output reused)
      t = tasks.get(stage_id, {})
      wall = (info.get('Completion Time', 0) -
              info.get('Submission Time', 0)) / 1e3
      out.append(
          f'    stage {stage_id:3} {info["Number of Tasks"]:3} tasks '
          f'{wall:7.2f} s wall, run {t.get("run", 0) / 1e3:7.2f} s, '
          f'cpu {t.get("cpu", 0) / 1e3:7.2f} s, gc {t.get("gc", 0) / 1e3:5.2f}'
          f' s, deser {t.get("deser", 0) / 1e3:5.2f} s, shuffle write '
          f'{t.get("write", 0) / 2**20:7.1f} MiB ({t.get("wtime", 0) / 1e3:5.2f}'
          f' s), read {t.get("read", 0) / 2**20:7.1f} MiB  '
          f'{info["Stage Name"][:60]}')
      if t.get('fetch'):
        out.append(f'      shuffle fetch wait {t["fetch"] / 1e3:.2f} s')
      if 0 < len(t.get('each', ())) <= 4:
        out.append('      tasks (run s, JVM cpu s, read MiB): ' + ', '.join(
            f'({r:.1f}, {c:.1f}, {m:.0f})' for r, c, m in t['each']))
  return out


def tree_cpu(root) -> dict:
  """CPU seconds of ``root``'s process tree so far, by kind: java (the
  JVM), python (Python workers and their daemon, with reaped ones)."""
  import psutil  # pylint: disable=import-outside-toplevel
  out = {'java': 0.0, 'python': 0.0}
  try:
    procs = [root] + root.children(recursive=True)
  except psutil.NoSuchProcess:
    return out
  for proc in procs:
    try:
      times = proc.cpu_times()
      kind = 'java' if 'java' in proc.name() else 'python'
    except psutil.NoSuchProcess:
      continue
    out[kind] += (times.user + times.system + times.children_user +
                  times.children_system)
  return out


def _cpu(roots: dict) -> dict:
  own = os.times()
  totals = {'client': own.user + own.system}
  for name, root in roots.items():
    for kind, secs in tree_cpu(root).items():
      totals[f'{name} {kind}'] = totals.get(f'{name} {kind}', 0) + secs
  return totals


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--size-mb', type=float, default=20)
  parser.add_argument('--workload', default='groupbykey')
  parser.add_argument('--out', default='out/bench/connect-profile')
  parser.add_argument('--engines', default='rdd,connect')
  parser.add_argument('--repeats', type=int, default=1)
  args = parser.parse_args(argv)
  # Absolute: a Connect server runs its Python workers in a directory of
  # the session's own.
  args.out = os.path.abspath(args.out)
  os.makedirs(args.out, exist_ok=True)
  corpus_dir = os.path.join(args.out, 'corpus')
  import_paths()
  from connect_server import ConnectServer  # pylint: disable=import-outside-toplevel
  from beam_pyspark.spark.session import spark_context  # pylint: disable=import-outside-toplevel
  logs = {e: tempfile.mkdtemp(prefix=f'events-{e}-') for e in ('rdd', 'connect')}
  server_dir = tempfile.mkdtemp(prefix='profile-connect-')
  event_conf = lambda e: {'spark.eventLog.enabled': 'true',
                          'spark.eventLog.dir': f'file://{logs[e]}',
                          'spark.eventLog.compress': 'false'}
  server = ConnectServer(server_dir, env={'PYTHONPATH': REPO_ROOT},
                         conf=event_conf('connect'))
  try:
    spark_context('local[2]', event_conf('rdd'))
    import psutil  # pylint: disable=import-outside-toplevel
    roots = {'rdd': [p for p in psutil.Process().children()
                     if 'java' in p.name() and p.pid != server.proc.pid][0],
             'connect': psutil.Process(server.proc.pid)}
    workload = wl.WORKLOADS[args.workload]
    report = []
    engines = args.engines.split(',')
    runs = [(e, WARMUP_MB) for e in engines] + [
        (e, args.size_mb) for r in range(args.repeats)
        for e in (engines if r % 2 == 0 else engines[::-1])]
    for engine, size in runs:
      paths = {role: corpus.ensure(corpus_dir, kind, size)
               for role, kind in workload.inputs.items()}
      output = os.path.join(args.out, 'runs', engine, 'out')
      shutil.rmtree(os.path.dirname(output), ignore_errors=True)
      os.makedirs(os.path.dirname(output))
      since = time.time() * 1e3
      before = _cpu(roots)
      started = time.monotonic()
      wl.run_beam(workload, _flags(engine, server.url), paths, output)
      secs = time.monotonic() - started
      after = _cpu(roots)
      cpu = {k: after[k] - before[k] for k in after
             if after[k] - before[k] > 0.05}
      print(f'{engine}: {args.workload} {size:g} MiB {secs:.2f} s '
            f'(load {os.getloadavg()[0]:.1f}); CPU s: ' + ', '.join(
                f'{k} {v:.2f}' for k, v in sorted(cpu.items())), flush=True)
      if size != WARMUP_MB and engine not in [r[0] for r in report]:
        report.append((engine, since))
    time.sleep(2)  # the event logs flushed
    for engine, since in report:
      print(f'{engine}: the first measured run\'s Spark jobs')
      print('\n'.join(summarize(_events(logs[engine]), since)), flush=True)
  finally:
    server.stop()
    shutil.rmtree(server_dir, ignore_errors=True)
    print(f'event logs: {logs}')


if __name__ == '__main__':
  run_and_exit(main)
