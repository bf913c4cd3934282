"""Where ours spends a streaming count's time: a fixed cost per micro-batch
and a cost per event, from runs at two offered rates.

    python -m benchmarks.streaming_profile [--rate 400000] [--low-rate 200000]
        [--seconds 30] [--warmup 8] [--lead 30] [--py-spy PATH]

The job is benchmarks/streaming_throughput.py's ``ours`` (PeriodicImpulse
-> key Map -> 1 s fixed windows -> count per key), each rate in a fresh
process. From each run, over the micro-batches that ended after the
warm-up while its events were offered (their job messages, "Micro-batch
N: S s", with when each ended):

* micro-batches (those that ended after the warm-up, up to the last
  pane), their mean wall time, events per micro-batch (the counts of the
  panes that arrived over them: what they counted, kept up or behind),
  and the process tree's CPU seconds over the same span (JVM, driver and
  Python workers, from /proc);
* a line through the two rates' points: wall ms per micro-batch =
  fixed + per-event x events, and CPU ms per micro-batch likewise. The
  intercepts are what a micro-batch costs whatever it reads (Spark's
  trigger, jobs, stages and tasks, the commit); the slopes what each event
  costs. The machine is shared: two points on a noisy machine give a rough
  line; run it on an idle one (its load is printed).

With ``--py-spy`` (``pip install py-spy``, a binary of its own), the run
at ``--rate`` is sampled over its events (after the warm-up) in every
Python process of the tree (the driver, PySpark's daemon and workers), and
the seconds sampled per command line and the functions taking the most
samples (self time) are printed.

Micro-batches that ended before the events began (within ``--lead``, once
Spark started) read nothing: their mean wall time and CPU are printed too,
the fixed cost measured directly.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import profile
from benchmarks import streaming_throughput as st


def steady(stats: dict, rate: float, seconds: float, warmup: float) -> dict:
  """The micro-batches that ended after the warm-up until the last pane
  (while events were offered, and a backlog after them if it fell behind):
  how many, their wall time, the events they counted (the panes that
  arrived over them: each micro-batch's timer wave fires its windows before
  it ends), CPU each."""
  start = stats['start']
  last_pane = max((at for _, at, _ in stats['panes']), default=0.0)
  ends = [(at, secs) for at, secs in stats.get('micro_batches', [])
          if start + warmup < at <= last_pane + 1.0]
  if len(ends) < 2:
    seen = stats.get('micro_batches', [])
    first = (f'; its first of {len(seen)} ended {seen[0][0] - start:.1f} s '
             'after the events began (a longer --lead gives Spark time to '
             'start)' if seen else '; no job message was seen')
    raise RuntimeError(
        f'{len(ends)} micro-batch(es) ended between {warmup} s and '
        f'{seconds} s of events at {rate:.0f}/s: too few to profile{first}')
  # The first one only marks where the span starts.
  t0, t1 = ends[0][0], ends[-1][0]
  span = t1 - t0
  batches = ends[1:]
  events = sum(n for _, at, n in stats['panes'] if t0 < at <= t1)
  cpu = st._at(stats['cpu'], t1) - st._at(stats['cpu'], t0)
  return {
      'rate': rate,
      'batches': len(batches),
      'batch_ms': 1000 * sum(s for _, s in batches) / len(batches),
      'events_per_batch': events / len(batches),
      'events_per_sec': events / span if span > 0 else float('nan'),
      'cpu_ms_per_batch': 1000 * cpu / len(batches),
      'cores': cpu / span if span > 0 else float('nan'),
      'cpu_secs_per_million': cpu * 1e6 / max(events, 1),
  }


def idle(stats: dict) -> dict:
  """The micro-batches that ended before the events began (after Spark's
  start-up, within --lead): what a micro-batch costs that reads nothing,
  its wall time and CPU each (the first only marks where the span
  starts)."""
  ends = [(at, secs) for at, secs in stats.get('micro_batches', [])
          if at < stats['start']]
  if len(ends) < 2:
    return {'idle_batches': 0}
  batches = ends[1:]
  cpu = (st._at(stats['cpu'], ends[-1][0]) -
         st._at(stats['cpu'], ends[0][0]))
  return {'idle_batches': len(batches),
          'idle_batch_ms': 1000 * sum(s for _, s in batches) / len(batches),
          'idle_cpu_ms_per_batch': 1000 * cpu / len(batches)}


def fit(low: dict, high: dict, key: str) -> tuple[float, float]:
  """(intercept, slope) of ``key`` per micro-batch against events per
  micro-batch through the two runs' points."""
  de = high['events_per_batch'] - low['events_per_batch']
  if abs(de) < 1:
    return float('nan'), float('nan')
  slope = (high[key] - low[key]) / de
  return low[key] - slope * low['events_per_batch'], slope


class PySpyLater:
  """py-spy over a run's event span: starts ``delay`` seconds after the
  process does, for ``duration`` seconds, every Python process below it."""
  def __init__(self, exe: str, output: str, delay: float, duration: float,
               rate: int = 100):
    self.exe, self.output, self.rate = exe, output, rate
    self.delay, self.duration = delay, duration
    self.thread = None
    self.error = ''

  def __call__(self, pid: int) -> None:
    def record():
      time.sleep(self.delay)
      done = subprocess.run(
          [self.exe, 'record', '--pid', str(pid), '--subprocesses',
           '--rate', str(self.rate), '--duration', str(int(self.duration)),
           '--format', 'raw', '--full-filenames', '--nonblocking',
           '--output', self.output],
          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
      if done.returncode != 0:
        self.error = done.stderr.decode(errors='replace')[-2000:]
    self.thread = threading.Thread(target=record, daemon=True)
    self.thread.start()

  def report(self, top: int = 25) -> dict:
    if self.thread is not None:
      self.thread.join(timeout=self.duration + 120)
    if not os.path.exists(self.output):
      return {'error': f'py-spy wrote nothing: {self.error}'}
    self_time = collections.Counter()
    by_kind = collections.Counter()
    for pids, frames, count in parse_raw(self.output):
      secs = count / self.rate
      # By the sampled process's command line (PySpark's workers are
      # forked from its daemon: the same one).
      by_kind[pids[-1][1][:80] if pids else '?'] += secs
      if frames:
        fn, path = frames[-1]
        self_time[f'{fn} ({short(path)})'] += secs
    return {'by_command': dict(by_kind.most_common()),
            'top_self': dict(self_time.most_common(top))}


def parse_raw(path: str):
  """py-spy's raw format (``benchmarks.profile.parse_raw``), each pid of a
  stack's chain with its command line."""
  return profile.parse_raw(path, commands=True)


def short(path: str) -> str:
  for marker in ('site-packages/', 'beam_pyspark/'):
    if marker in path:
      head = '' if marker == 'site-packages/' else marker
      return head + path.split(marker, 1)[1]
  return path


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rate', type=float, default=400000)
  parser.add_argument('--low-rate', type=float, default=None,
                      help='the second point (default: half of --rate)')
  parser.add_argument('--seconds', type=float, default=30)
  parser.add_argument('--warmup', type=float, default=8)
  parser.add_argument('--lead', type=float, default=30)
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--py-spy', help='py-spy to sample the run at --rate')
  parser.add_argument('--ours-flag', action='append', default=[])
  parser.add_argument('--json', help='Also write the results here.')
  args = parser.parse_args(argv)
  low_rate = args.low_rate or args.rate / 2
  points, spy = {}, None
  with tempfile.TemporaryDirectory(prefix='beam-pyspark-prof-') as tmp:
    for rate in (low_rate, args.rate):
      observe = None
      if args.py_spy and rate == args.rate:
        spy = observe = PySpyLater(
            args.py_spy, os.path.join(tmp, 'pyspy.txt'),
            delay=args.lead + args.warmup,
            duration=args.seconds - args.warmup)
      load_before = os.getloadavg()[0]
      stats = st.run_once('ours', rate, args.seconds, args.lead, args.master,
                          sys.executable, args.ours_flag, observe=observe)
      point = steady(stats, rate, args.seconds, args.warmup)
      point.update(idle(stats))
      point.update(load_before=load_before, load_after=os.getloadavg()[0])
      points[rate] = point
      print(json.dumps(point, sort_keys=True), flush=True)
    profile = spy.report() if spy is not None else None
  low, high = points[low_rate], points[args.rate]
  fixed_ms, per_event_ms = fit(low, high, 'batch_ms')
  fixed_cpu_ms, per_event_cpu_ms = fit(low, high, 'cpu_ms_per_batch')
  apart = high['events_per_batch'] / max(low['events_per_batch'], 1)
  print()
  print('| offered/s | counted/s | micro-batches | wall ms each | events '
        'each | CPU ms each | cores | CPU s per M events | load '
        'before-after |')
  print('|---|---|---|---|---|---|---|---|---|')
  for p in (low, high):
    print(f'| {p["rate"]:,.0f} | {p["events_per_sec"]:,.0f} | '
          f'{p["batches"]} | {p["batch_ms"]:.0f} | '
          f'{p["events_per_batch"]:,.0f} | {p["cpu_ms_per_batch"]:.0f} | '
          f'{p["cores"]:.2f} | {p["cpu_secs_per_million"]:.2f} | '
          f'{p["load_before"]:.1f}-{p["load_after"]:.1f} |')
  print()
  for p in (low, high):
    if p['idle_batches']:
      print(f'Before its events ({p["rate"]:,.0f}/s run): '
            f'{p["idle_batches"]} micro-batches that read nothing, '
            f'{p["idle_batch_ms"]:.0f} ms wall and '
            f'{p["idle_cpu_ms_per_batch"]:.0f} CPU-ms each')
  if apart < 1.3:
    # Both read about as much per micro-batch (both behind, at the most
    # their budget or the machine lets them): a line through them says
    # nothing.
    print(f'No line: the runs read {low["events_per_batch"]:,.0f} and '
          f'{high["events_per_batch"]:,.0f} events per micro-batch, too '
          'close (both behind?); a lower --low-rate, or an idle machine. '
          'Per event at most (all CPU counted as per event): '
          f'{min(low["cpu_secs_per_million"], high["cpu_secs_per_million"]):.2f}'
          ' CPU-s per million events')
  else:
    print(f'Per micro-batch, whatever it reads: {fixed_ms:.0f} ms wall, '
          f'{fixed_cpu_ms:.0f} CPU-ms')
    print(f'Per event: {per_event_ms * 1e3:.2f} us wall, '
          f'{per_event_cpu_ms * 1e3:.2f} CPU-us '
          f'({per_event_cpu_ms * 1e3:.2f} CPU-s per million events)')
  if profile is not None:
    print()
    if 'error' in profile:
      print(profile['error'])
    else:
      print(f'py-spy at {args.rate:,.0f}/s over its events, seconds '
            'sampled by command line:')
      for command, secs in profile['by_command'].items():
        print(f'  {secs:7.1f} s  {command}')
      print('by function (self time):')
      for name, secs in profile['top_self'].items():
        print(f'  {secs:7.1f} s  {name}')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump({'points': list(points.values()),
                 'fixed_ms': fixed_ms, 'per_event_ms': per_event_ms,
                 'fixed_cpu_ms': fixed_cpu_ms,
                 'per_event_cpu_ms': per_event_cpu_ms,
                 'profile': profile}, f, indent=1)


if __name__ == '__main__':
  main()
