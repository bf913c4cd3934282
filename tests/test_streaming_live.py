"""The streaming guide's example (docs/guide/streaming.md), run as a user
runs it: its windows arrive while its source runs, and Ctrl-C stops it
with its checkpoint kept and a line saying how to resume, not a Java
trace.

One run of examples/streaming_counts.py in a process of its own, with a
``--checkpoint_location``: the test reads the first window's file while
the PeriodicImpulse still has minutes to run, then sends SIGINT, as
Ctrl-C in a terminal does.
"""
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, 'examples', 'streaming_counts.py')
# How long the source runs: far longer than the test waits, so that a
# window file seen before the end was written while it ran.
SOURCE_SECS = 900
WINDOW_WAIT_SECS = 400
STOP_WAIT_SECS = 180


def _window_files(directory: str) -> list[str]:
  if not os.path.isdir(directory):
    return []
  return sorted(n for n in os.listdir(directory)
                if not n.startswith('.') and
                os.path.isfile(os.path.join(directory, n)))


def _as_from_a_terminal():
  # Ctrl-C's default, as a command typed in a terminal has it: a suite run
  # in the background (or under nohup) hands its children SIGINT ignored,
  # and Python then never raises KeyboardInterrupt.
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_windows_arrive_while_the_source_runs_and_ctrl_c_keeps_the_checkpoint(
    tmp_path):
  output = str(tmp_path / 'counts')
  checkpoint = str(tmp_path / 'checkpoint')
  log_path = tmp_path / 'example.log'
  started = time.time()
  with open(log_path, 'wb') as log:
    proc = subprocess.Popen(
        [sys.executable, EXAMPLE, '--output', output,
         '--runner=beam_pyspark.PySparkRunner', '--streaming',
         '--spark_master_url=local[2]', f'--seconds={SOURCE_SECS}',
         '--rate=50', f'--checkpoint_location={checkpoint}'],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        preexec_fn=_as_from_a_terminal)
  try:
    files = []
    while time.time() - started < WINDOW_WAIT_SECS and proc.poll() is None:
      files = _window_files(output)
      if files:
        break
      time.sleep(0.5)
    text = log_path.read_text(errors='replace')
    assert files, (f'no window file in {WINDOW_WAIT_SECS} s '
                   f'(exit {proc.poll()}):\n{text[-5000:]}')
    first_window = time.time() - started
    # Written while the source had most of its time still to run.
    assert proc.poll() is None and first_window < SOURCE_SECS
    lines = open(os.path.join(output, files[0]), encoding='utf-8').read()
    assert lines.strip() and all(': ' in line for line in lines.splitlines())
    print(f'first window file after {first_window:.1f} s: {files[0]}')

    proc.send_signal(signal.SIGINT)  # Ctrl-C
    proc.wait(timeout=STOP_WAIT_SECS)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  text = log_path.read_text(errors='replace')
  assert proc.returncode == 130, (proc.returncode, text[-5000:])
  assert (f'stopped, checkpoint kept at {checkpoint}: run the same pipeline '
          'with that --checkpoint_location again to resume.') in text, (
              text[-5000:])
  # No Java stack trace: no JVM frame, no py4j error.
  java = [line for line in text.splitlines()
          if line.startswith('\tat ') or 'Py4JError' in line or
          'Py4JNetworkError' in line or 'java.lang.' in line]
  assert not java, '\n'.join(java[:30])
  # The checkpoint is there to resume from: committed micro-batches.
  assert os.listdir(os.path.join(checkpoint, 'manifests'))


STARTUP_STOP_SECS = 10


def test_ctrl_c_during_start_up_stops_within_seconds_without_a_traceback(
    tmp_path):
  """Ctrl-C as a terminal sends it (to the whole process group: Spark's
  JVM and Python workers too) once the job runs, before its query's
  first micro-batch: the program ends in seconds with its one line."""
  checkpoint = str(tmp_path / 'checkpoint')
  log_path = tmp_path / 'example.log'
  with open(log_path, 'wb') as log:
    proc = subprocess.Popen(
        [sys.executable, EXAMPLE, '--output', str(tmp_path / 'counts'),
         '--runner=beam_pyspark.PySparkRunner', '--streaming',
         '--spark_master_url=local[2]', f'--seconds={SOURCE_SECS}',
         '--rate=50', f'--checkpoint_location={checkpoint}'],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        preexec_fn=_as_from_a_terminal, start_new_session=True)
  try:
    started = time.time()
    # The engine runs: its Spark session and query are starting.
    while (proc.poll() is None and time.time() - started < WINDOW_WAIT_SECS
           and 'Running job' not in log_path.read_text(errors='replace')):
      time.sleep(0.1)
    assert proc.poll() is None, log_path.read_text(errors='replace')[-5000:]
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    signalled = time.time()
    try:
      proc.wait(timeout=STARTUP_STOP_SECS)
    except subprocess.TimeoutExpired:
      pass
    stopped_in = time.time() - signalled
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  text = log_path.read_text(errors='replace')
  assert stopped_in < STARTUP_STOP_SECS, (stopped_in, text[-5000:])
  assert proc.returncode == 130, (proc.returncode, text[-5000:])
  assert 'stopped, checkpoint kept at' in text, text[-5000:]
  assert 'Traceback' not in text, text[-8000:]
  java = [line for line in text.splitlines()
          if line.startswith('\tat ') or 'Py4J' in line or 'java.' in line]
  assert not java, '\n'.join(java[:30])
