"""What a tiny pipeline costs in a fresh process: ours against the DirectRunner.

    python -m benchmarks.fixed_cost [--repeats 5] [--master local[*]]

A new user's first pipeline is small, and its time is all fixed cost:
imports, starting Spark's JVM, starting Python workers and importing Beam
in them. Each repeat starts a fresh Python process per variant (the order
alternates, so a burst of load on a shared machine does not always fall on
the same one) that builds and runs a three-element pipeline
(Create -> Map -> Map), and the parent times the whole process. Printed:
each variant's median wall time, the ratio ours / DirectRunner, and for
ours where its time went (from the child's own clock: Beam imported,
Spark started, the job's Spark actions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CHILD = r'''
import json, sys, time
T0 = time.time()
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
marks = {'beam_imported': time.time() - T0}
runner = sys.argv[1]
flags = ['--runner=' + runner] + sys.argv[2:]
if runner != 'DirectRunner':
  import beam_pyspark.spark.session as session
  start = session.spark_context
  def timed(*a, **k):
    t = time.time(); sc = start(*a, **k)
    marks['spark_started'] = time.time() - t
    return sc
  session.spark_context = timed
with beam.Pipeline(options=PipelineOptions(flags)) as p:
  _ = (p | beam.Create(['a', 'b', 'c']) | beam.Map(str.upper)
       | beam.Map(lambda x: None))
marks['pipeline_done'] = time.time() - T0
print('MARKS ' + json.dumps(marks))
'''


def run_once(runner: str, extra: list[str]) -> tuple[float, dict]:
  started = time.monotonic()
  done = subprocess.run(
      [sys.executable, '-c', _CHILD, runner] + extra,
      capture_output=True, text=True, check=False, timeout=600)
  wall = time.monotonic() - started
  if done.returncode != 0:
    raise RuntimeError(
        f'{runner} failed ({done.returncode}):\n{done.stderr[-3000:]}')
  marks = {}
  for line in done.stdout.splitlines():
    if line.startswith('MARKS '):
      marks = json.loads(line[len('MARKS '):])
  return wall, marks


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--master', default=None,
                      help="Spark master for ours (default: the runner's, "
                      'local[*])')
  args = parser.parse_args(argv)
  ours_flags = [f'--spark_master_url={args.master}'] if args.master else []
  variants = {
      'direct': ('DirectRunner', []),
      'ours': ('beam_pyspark.PySparkRunner', ours_flags),
  }
  times: dict[str, list[float]] = {name: [] for name in variants}
  marks: list[dict] = []
  for i in range(args.repeats):
    order = list(variants) if i % 2 == 0 else list(reversed(variants))
    for name in order:
      runner, extra = variants[name]
      wall, mark = run_once(runner, extra)
      times[name].append(wall)
      if name == 'ours':
        marks.append(mark)
      print(f'  repeat {i + 1} {name:7s} {wall:6.2f} s', flush=True)
  print(f'load average: {os.getloadavg()[0]:.1f}')
  medians = {name: statistics.median(t) for name, t in times.items()}
  for name, median in medians.items():
    print(f'{name:7s} median {median:6.2f} s  (runs: '
          f'{", ".join(f"{t:.2f}" for t in times[name])})')
  print(f'ours / direct: {medians["ours"] / medians["direct"]:.2f}x')
  if marks:
    def med(key):
      return statistics.median(m.get(key, float('nan')) for m in marks)
    print(f'ours, in the child (medians): Beam imported at '
          f'{med("beam_imported"):.2f} s, Spark started in '
          f'{med("spark_started"):.2f} s, pipeline done at '
          f'{med("pipeline_done"):.2f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
