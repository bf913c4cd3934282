"""PySparkRunner's progress where its program runs (--progress).

The formatting and the reporter's loop with plain data (no Spark); then a
real program on a pseudo-terminal, as a person at a terminal sees it, and
a real job with --progress=log.
"""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import select
import subprocess
import sys
import time

from apache_beam.metrics import monitoring_infos as mi

from beam_pyspark import console
from beam_pyspark.events import JobState

TESTS = os.path.dirname(os.path.abspath(__file__))
STAGES = [('s1', ['Numbers/Impulse', 'Numbers/FlatMap']), ('s2', ['Spread']),
          ('s3', ['Slowly', 'Format'])]


def _infos():
  return [mi.int64_counter(mi.ELEMENT_COUNT_URN, 1200, pcollection='p1'),
          mi.int64_counter(mi.ELEMENT_COUNT_URN, 34, pcollection='p2'),
          mi.int64_user_counter('ns', 'small', 3),
          mi.int64_user_counter('ns', 'big', 900)]


def test_the_line_names_the_stage_its_transforms_tasks_and_elements():
  progress = {'tasks_done': 5, 'tasks_total': 12, 'tasks_active': 2,
              'beam_stages': {'s1': 1}}
  line = console.progress_line('job-1', STAGES, progress, _infos())
  assert line == ('job-1 | stage 2/3 (Spread) | tasks 5/12 (2 running) | '
                  '1,234 elements')
  progress['beam_stages'] = {'s1': 1, 's3': 4}
  assert 'stage 3/3 (Slowly, Format)' in console.progress_line(
      'job-1', STAGES, progress, [])
  assert console.progress_line('job-1', [], None, []) == (
      'job-1 | 0 elements')


def test_the_summary_has_state_duration_and_the_largest_counters():
  text = console.summary('job-1', JobState.DONE, 12.34, _infos())
  assert text == 'Job job-1 DONE in 12.3 s; counters: ns/big=900, ns/small=3'


class _Job:
  """Ends after ``ticks`` waits; records each wait's timeout."""
  def __init__(self, ticks):
    self.ticks = ticks
    self.timeouts = []

  def wait_ended(self, timeout):
    self.timeouts.append(timeout)
    return JobState.DONE if len(self.timeouts) > self.ticks else None


def test_on_a_terminal_one_line_is_rewritten_then_closed_by_the_summary(
    monkeypatch):
  # The line is cut to the terminal's width; this one is wide enough (the
  # test's own terminal may not be, e.g. a pytest-xdist worker's).
  monkeypatch.setenv('COLUMNS', '200')
  job, stream = _Job(3), io.StringIO()
  done = iter([2, 4, 6])
  reporter = console.ProgressReporter(
      console.AUTO, 'job-1', lambda: STAGES,
      lambda: {'tasks_done': next(done, 6), 'tasks_total': 6,
               'beam_stages': {}},
      _infos, job.wait_ended, stream, logging.getLogger('test'),
      links=lambda: 'status page http://localhost:1/jobs/job-1').start()
  reporter.join()
  out = stream.getvalue()
  assert job.timeouts == [console.TERMINAL_SECS] * 4  # once a second
  lines = out.split('\n')
  assert lines[0] == '\rJob job-1: status page http://localhost:1/jobs/job-1'
  frames = lines[1].split('\r')
  assert [f for f in frames if 'tasks' in f] == [
      f'job-1 | stage 1/3 (Numbers/Impulse, Numbers/FlatMap) | tasks {n}/6 | '
      '1,234 elements' for n in (2, 4, 6)]
  assert frames[-1].startswith('Job job-1 DONE in ')  # after a cleared line
  assert frames[-2].strip() == ''


def test_off_a_terminal_a_log_line_every_30_seconds(caplog):
  job, stream = _Job(2), io.StringIO()
  with caplog.at_level(logging.INFO, logger='test-progress'):
    console.ProgressReporter(
        console.LOG, 'job-1', lambda: STAGES,
        lambda: {'tasks_done': 1, 'tasks_total': 2, 'beam_stages': {}},
        _infos, job.wait_ended, stream,
        logging.getLogger('test-progress')).start().join()
  assert job.timeouts == [console.LOG_SECS] * 3
  messages = [r.getMessage() for r in caplog.records]
  assert messages[:2] == ['job-1 | stage 1/3 (Numbers/Impulse, '
                          'Numbers/FlatMap) | tasks 1/2 | 1,234 elements'] * 2
  assert messages[2].startswith('Job job-1 DONE in ')
  assert stream.getvalue() == ''  # nothing on the stream off a terminal


_PROGRAM = '''
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from status_jobs import Slow
options = PipelineOptions(['--runner=beam_pyspark.PySparkRunner',
    '--spark_master_url=local[2]', '--spark_parallelism=4', '--status_port=0',
    '--job_name=tty', '--progress=auto'])
# Four tasks of 3 s on two cores: two waves, so the line (redrawn each
# second) shows the task count change even on a loaded machine (with 0.6 s
# an element it once showed only one count before the stage ended).
with beam.Pipeline(options=options) as p:
  _ = (p | beam.Create(list(range(8))) | beam.Reshuffle()
       | 'Slowly' >> beam.ParDo(Slow(1.5)))
print('program ends', flush=True)
'''


def test_a_program_on_a_terminal_sees_its_links_progress_and_summary():
  leader, follower = pty.openpty()
  proc = subprocess.Popen(
      [sys.executable, '-c', _PROGRAM], stdin=subprocess.DEVNULL,
      stdout=follower, stderr=follower,
      env={**os.environ, 'PYTHONPATH': TESTS, 'COLUMNS': '200'})
  os.close(follower)
  out = b''
  deadline = time.monotonic() + 240
  try:
    while time.monotonic() < deadline:
      ready, _, _ = select.select([leader], [], [], 1)
      if ready:
        try:
          chunk = os.read(leader, 65536)
        except OSError:  # the program ended and closed the terminal
          break
        if not chunk:
          break
        out += chunk
      elif proc.poll() is not None:
        break
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(30)
    os.close(leader)
  text = out.decode('utf-8', 'replace')
  assert proc.returncode == 0, text[-3000:]
  assert re.search(r'Job tty-\w+: status page http://localhost:\d+/jobs/'
                   r'tty-\w+, Spark UI http://\S+', text), text[-3000:]
  frames = re.findall(r'\r(tty-\w+ \| stage \d/\d \([^)]*\) \| tasks '
                      r'(\d+)/(\d+)[^\r\n]*)', text)
  assert frames, text[-3000:]
  done = [int(d) for _, d, _ in frames]
  assert done == sorted(done), frames
  # Between the last stage's two waves the line shows the first wave done:
  # a count of the last stage's tasks other than none and all of them
  # (Spark's status store kept up, spark.ui.liveUpdate.period; at its
  # default it caught up at the next heartbeat, after both waves).
  total = int(frames[-1][2])
  assert any(total - 4 < d < total for d in done), frames
  summary = re.search(r'Job tty-\w+ DONE in [\d.]+ s; counters: '
                      r'status/slow_elements=8', text)
  assert summary and summary.start() < text.index('program ends'), (
      text[-3000:])


def test_progress_log_mode_logs_the_summary(client_log):
  import apache_beam as beam
  from conftest import spark_options
  from status_jobs import Slow
  with beam.Pipeline(options=spark_options(progress='log',
                                           job_name='logged')) as p:
    _ = p | beam.Create([1, 2, 3]) | beam.ParDo(Slow(0))
  summaries = [m for level, m in client_log.seen if level == logging.INFO
               and re.match(r'Job logged-\w+ DONE in [\d.]+ s; counters: '
                            r'status/slow_elements=3$', m)]
  assert len(summaries) == 1, client_log.seen
