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
``example``, the streaming guide's examples/streaming_counts.py pipeline (200
events a second). Printed: the medians of each phase, and the whole, for
each of the two.
Issue 31's target: an idle job's first micro-batch within 5 s of
"Running job" on an idle machine.

``--first-window``: the README's streaming example as the README runs it,
seconds from "Running job" (and from its launch) to its first window's
file (issue 43's target: 15 s from "Running job" on an idle machine).

``--job-server`` measures the same for the first job a fresh job server
runs, from the job's own messages ("Running job" to "Micro-batch 0"),
with the server's default warm-up (Spark started at the server's start;
the job submitted once it is done) and with ``--no-spark-warm-up`` (the
job starts Spark), alternating, a fresh server each time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

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


def _job_server(warm: bool, tmp: str):
  """A fresh job server; returns (process, job endpoint, seconds until
  its warm-up ended or None)."""
  log_path = os.path.join(tmp, 'server.log')
  log = open(log_path, 'wb')  # pylint: disable=consider-using-with
  started = time.monotonic()
  proc = subprocess.Popen(
      [sys.executable, '-m', 'beam_pyspark.cli', 'job-server',
       '--job-port', '0', '--artifact-port', '0', '--expansion-port', '-1',
       '--status-port', '-1', '--artifacts-dir', os.path.join(tmp, 'art'),
       '--spark-master-url', 'local[2]',
       '--spark-warm-up' if warm else '--no-spark-warm-up'],
      stdout=subprocess.PIPE, stderr=log, text=True)
  endpoint = None
  for line in proc.stdout:
    if line.startswith('Job service listening on '):
      endpoint = line.split()[-1]
      break
  if endpoint is None:
    raise RuntimeError(f'job server exited ({proc.wait()})')
  warmed = None
  while warm and warmed is None:
    with open(log_path, encoding='utf-8', errors='replace') as f:
      text = f.read()
    if 'warmed up for jobs' in text:
      warmed = time.monotonic() - started
    elif 'Could not start Spark' in text or proc.poll() is not None:
      raise RuntimeError(f'warm-up failed:\n{text[-3000:]}')
    elif time.monotonic() - started > 600:
      raise RuntimeError('warm-up took more than 600 s')
    else:
      time.sleep(0.2)
  return proc, endpoint, warmed


def first_job_on_a_server(warm: bool) -> dict:
  """Seconds from "Running job" to "Micro-batch 0" of an idle streaming
  job, the first a fresh job server runs."""
  import apache_beam as beam  # pylint: disable=import-outside-toplevel
  import grpc  # pylint: disable=import-outside-toplevel
  from apache_beam.options.pipeline_options import PipelineOptions  # pylint: disable=import-outside-toplevel
  from apache_beam.portability.api import beam_job_api_pb2  # pylint: disable=import-outside-toplevel
  from apache_beam.portability.api import beam_job_api_pb2_grpc  # pylint: disable=import-outside-toplevel
  from apache_beam.transforms.periodicsequence import PeriodicImpulse  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory(prefix='bench-startup-server-') as tmp:
    proc, endpoint, warmed = _job_server(warm, tmp)
    try:
      start = time.time()
      p = beam.Pipeline(options=PipelineOptions([
          '--runner=PortableRunner', f'--job_endpoint={endpoint}',
          '--environment_type=beam:env:embedded_python:v1', '--streaming']))
      _ = (p | PeriodicImpulse(start_timestamp=start,
                               stop_timestamp=start + 7200,
                               fire_interval=3600)
           | beam.Map(lambda x: x))
      result = p.run()
      stub = beam_job_api_pb2_grpc.JobServiceStub(
          grpc.insecure_channel(endpoint))
      marks, texts = {}, []
      for response in stub.GetMessageStream(
          beam_job_api_pb2.JobMessagesRequest(job_id=result._job_id),  # pylint: disable=protected-access
          timeout=600):
        message = response.message_response
        if not response.HasField('message_response'):
          continue
        millis = int(message.time) / 1000
        texts.append(message.message_text)
        if message.message_text.startswith('Running job'):
          marks.setdefault('running', millis)
        if message.message_text.startswith('Micro-batch 0:'):
          marks['batch_0'] = millis
          break
      result.cancel()
    finally:
      proc.terminate()
      try:
        proc.wait(60)
      except subprocess.TimeoutExpired:
        proc.kill()
  if len(marks) < 2:
    raise RuntimeError('no "Running job" and "Micro-batch 0" in the job\'s '
                       'messages:\n' + '\n'.join(texts))
  return {'warm_up': warmed, 'live': marks['batch_0'] - marks['running']}


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'examples', 'streaming_counts.py')


def first_window(master: str, seconds: float = 120) -> dict:
  """The README's streaming example run as the README runs it (its own
  process, 10-second windows of a 200 events/s PeriodicImpulse, written
  as each closes): seconds from its launch and from "Running job" to its
  first window's file, polled every 0.1 s; then Ctrl-C."""
  import signal  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory(prefix='bench-first-window-') as tmp:
    out = os.path.join(tmp, 'counts')
    launched = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, EXAMPLE, '--output', out, '--seconds', str(seconds),
         '--runner=beam_pyspark.PySparkRunner', '--streaming',
         f'--spark_master_url={master}',
         f'--checkpoint_location={os.path.join(tmp, "checkpoint")}'],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marks = {}

    def read_log():
      for line in proc.stderr:
        if 'Running job' in line:
          marks.setdefault('running', time.monotonic())
    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
      while time.monotonic() - launched < seconds + 300:
        if os.path.isdir(out) and any(not f.startswith('.')
                                      for f in os.listdir(out)):
          marks['window'] = time.monotonic()
          break
        if proc.poll() is not None:
          raise RuntimeError(f'the example exited ({proc.returncode}) '
                             'before its first window')
        time.sleep(0.1)
    finally:
      proc.send_signal(signal.SIGINT)
      try:
        proc.wait(60)
      except subprocess.TimeoutExpired:
        proc.kill()
  if 'window' not in marks or 'running' not in marks:
    raise RuntimeError(f'no first window or no "Running job": {marks}')
  return {'launch': marks['window'] - launched,
          'running': marks['window'] - marks['running']}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--jobs', default='idle,example')
  parser.add_argument('--job-server', action='store_true',
                      help='The first job of fresh job servers, with and '
                      'without their warm-up, instead.')
  parser.add_argument('--first-window', action='store_true',
                      help="The README's streaming example: seconds to "
                      'its first window\'s file, instead.')
  args = parser.parse_args(argv)
  print(f'load average at start: {os.getloadavg()[0]:.1f}')
  if args.first_window:
    runs = [first_window(args.master) for _ in range(args.repeats)]
    for key, label in (('running', '"Running job"'), ('launch', 'launch')):
      secs = [r[key] for r in runs]
      print(f'README streaming example, {label} -> first window file '
            f'({args.repeats} runs): median {statistics.median(secs):.1f} s '
            f'(min {min(secs):.1f}, max {max(secs):.1f})')
    print(f'load average at end: {os.getloadavg()[0]:.1f}')
    return
  if args.job_server:
    runs = {True: [], False: []}
    for _ in range(args.repeats):
      for warm in (True, False):
        runs[warm].append(first_job_on_a_server(warm))
    for warm, label in ((True, 'warmed up at start (default)'),
                        (False, '--no-spark-warm-up')):
      live = [r['live'] for r in runs[warm]]
      print(f'idle job, the first of a job server {label} '
            f'({args.repeats} runs): Running job -> micro-batch 0 done '
            f'median {statistics.median(live):.2f} s (min {min(live):.2f}, '
            f'max {max(live):.2f})')
      if warm:
        ups = [r['warm_up'] for r in runs[warm]]
        print(f'  the warm-up itself: median {statistics.median(ups):.1f} s '
              'from the server\'s start')
    print(f'load average at end: {os.getloadavg()[0]:.1f}')
    return
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
