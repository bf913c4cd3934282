"""How long a streaming job takes to go live: from "Running job" to the end
of its first micro-batch, and where that time goes.

    python -m benchmarks.streaming_startup [--repeats 3] [--master local[2]]
        [--jobs idle,example]

Each repeat runs each job in a fresh process (as a user's program runs)
on ``PySparkRunner`` with ``--streaming``, then the same job again in
that process (as a job server runs its second job: Spark's SQL machinery
is initialized by then), and reads the runner's log lines as they are
written, with the wall clock:

* ``Running job``: the job is planned and handed to the engine (Spark's
  JVM has started by then: the time before it is Spark's start-up, which
  benchmarks.fixed_cost measures);
* ``query started``: Spark's Structured Streaming query is running;
* ``offered``: Spark offered the first micro-batch (its first offsets
  logged) and the engine starts on it;
* ``Micro-batch 0``: the first micro-batch has run its waves and
  committed.

The jobs: ``idle``, a PeriodicImpulse firing once an hour (its first
micro-batch emits one element and has nothing more to do), and
``example``, the README's examples/streaming_counts.py pipeline (200
events a second). Printed: the medians of each phase, and the whole, for
each of the two.
Issue 31's target: an idle job's first micro-batch within 5 s of
"Running job" on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r'''
import logging, os, sys, threading, time
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse

job, master, checkpoint, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
marks = {}
live = threading.Event()
PATTERNS = {'Running job': 'running', 'query started': 'query_started',
            'Spark offered micro-batch 0': 'offered',
            'Micro-batch 0:': 'batch_0'}


class Marks(logging.Handler):
  def emit(self, record):
    text = record.getMessage()
    for pattern, name in PATTERNS.items():
      if pattern in text and name not in marks:
        marks[name] = record.created
        if name == 'batch_0':
          live.set()


logging.getLogger().addHandler(Marks())
logging.getLogger().setLevel(logging.DEBUG)
for noisy in ('py4j', 'grpc', 'urllib3', 'apache_beam'):
  logging.getLogger(noisy).setLevel(logging.WARNING)
for run in range(runs):
  options = PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--streaming',
      '--spark_master_url=' + master,
      '--checkpoint_location=%s-%d' % (checkpoint, run)])
  start = time.time()
  p = beam.Pipeline(options=options)
  if job == 'idle':
    _ = (p | PeriodicImpulse(start_timestamp=start, stop_timestamp=start + 7200,
                             fire_interval=3600)
         | beam.Map(lambda x: x))
  else:
    _ = (p | PeriodicImpulse(start_timestamp=start, stop_timestamp=start + 600,
                             fire_interval=1.0 / 200)
         | beam.Map(lambda t: str(int(float(t) * 1000) % 6))
         | beam.WindowInto(window.FixedWindows(10))
         | beam.combiners.Count.PerElement()
         | beam.Map(str))
  marks.clear()
  live.clear()
  result = p.run()
  live.wait(600)
  import json
  print('MARKS %d %s' % (run, json.dumps(marks)), flush=True)
  result.cancel()
os._exit(0)  # measured: nothing more to wait for
'''

PHASES = [('running', 'query_started', 'query start'),
          ('query_started', 'offered', 'first offsets'),
          ('offered', 'batch_0', 'micro-batch 0 (waves, commit)'),
          ('running', 'batch_0', 'Running job -> micro-batch 0 done')]


def run_once(job: str, master: str, runs: int) -> list[dict]:
  """The marks of ``runs`` jobs run one after the other in one process."""
  with tempfile.TemporaryDirectory(prefix='bench-startup-') as tmp:
    proc = subprocess.run(
        [sys.executable, '-c', _CHILD, job, master,
         os.path.join(tmp, 'checkpoint'), str(runs)],
        capture_output=True, text=True, timeout=1200, check=False)
  marks = [json.loads(line.split(' ', 2)[2])
           for line in proc.stdout.splitlines() if line.startswith('MARKS ')]
  if len(marks) != runs:
    raise RuntimeError(f'{job}: {len(marks)} of {runs} runs measured (exit '
                       f'{proc.returncode}):\n{proc.stderr[-3000:]}')
  return marks


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--jobs', default='idle,example')
  args = parser.parse_args(argv)
  print(f'load average at start: {os.getloadavg()[0]:.1f}')
  for job in args.jobs.split(','):
    fresh, again = [], []
    for _ in range(args.repeats):
      first, second = run_once(job, args.master, 2)
      fresh.append(first)
      again.append(second)
    for label, runs in (('in a fresh process', fresh),
                        ('the next job in the same process', again)):
      print(f'{job}, {label} ({args.repeats} runs, medians):')
      for begin, end, phase in PHASES:
        secs = [r[end] - r[begin] for r in runs if begin in r and end in r]
        if secs:
          print(f'  {phase:40s} {statistics.median(secs):6.2f} s  '
                f'(min {min(secs):.2f}, max {max(secs):.2f})')
  print(f'load average at end: {os.getloadavg()[0]:.1f}')



if __name__ == '__main__':
  main()
