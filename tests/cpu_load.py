"""A machine whose cores are all busy, for the streaming-under-load tests
(test_checkpoint_hdfs.py, test_xlang_kafka.py).

Spark gives the Python process it starts for a streaming query's source a
fixed 10 s to connect back (``beam_pyspark.spark.querystarts``): at load
30-90 on 2 cores streaming jobs failed before their first micro-batch.
``busy_cores()`` runs CPU-bound processes for as long as its block lasts
(keep it as short as the job: the other pytest-xdist worker is slowed as
well). ``slow_first_source_python()`` makes a query's first start fail the
way Spark's own failure presents on a loaded machine: the Python process
Spark launches for the first start of a streaming source takes longer than
those 10 s to connect back.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time

# Twice the cores of a 2-core CI machine: both cores busy all the time.
# (8 kept the other pytest worker at a fifth of a core for each test's ~3.5
# minutes; CI ran over its hour.) TEST_BUSY_PROCESSES=0 runs the same tests
# without the load: to compare their durations.
BUSY_PROCESSES = int(os.environ.get('TEST_BUSY_PROCESSES', '4'))
# Each busy process ends by itself after this long, should the test die
# before it stops them.
BUSY_SECS = 900
_BUSY = ('import time\nend = time.monotonic() + {secs}\n'
         'while time.monotonic() < end:\n  pass\n')


@contextlib.contextmanager
def busy_cores(processes: int = -1):
  """``processes`` CPU-bound processes (BUSY_PROCESSES by default) while
  the block runs."""
  if processes < 0:
    processes = BUSY_PROCESSES
  busy = [subprocess.Popen([sys.executable, '-c',
                            _BUSY.format(secs=BUSY_SECS)])
          for _ in range(processes)]
  try:
    time.sleep(2)  # the load is there before the job starts
    yield
  finally:
    for proc in busy:
      proc.kill()
    for proc in busy:
      proc.wait()


def load() -> str:
  return f'load {os.getloadavg()[0]:.1f}'


# Spark starts a streaming source's process as `PYTHON -m
# pyspark.sql.streaming.python_streaming_source_runner`; every other
# Python process (the daemon, workers, planners) runs unchanged.
_SLOW_FIRST = '''#!/bin/sh
case "$*" in
  *python_streaming_source_runner*)
    if mkdir {marker} 2>/dev/null; then
      sleep {secs}
      exit 1
    fi;;
esac
exec {python} "$@"
'''


def slow_first_source_python(directory: str, secs: int = 14) -> str:
  """A PYSPARK_PYTHON whose first streaming-source process sleeps
  ``secs`` (more than Spark's 10 s) before it gives up without connecting
  back; ``directory``/slow-source marks that it did."""
  path = os.path.join(directory, 'python-slow-first-source')
  with open(path, 'w', encoding='utf-8') as f:
    f.write(_SLOW_FIRST.format(
        marker=os.path.join(directory, 'slow-source'), secs=secs,
        python=sys.executable))
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
  return path


def run_logged(args: list[str], log_path: str, timeout: float,
               **kwargs) -> tuple[int, str]:
  """Runs a driver with its output in ``log_path`` (there to read when it
  hangs too): its exit code (None if it did not end within ``timeout``
  and was killed) and its output."""
  started = time.monotonic()
  with open(log_path, 'w', encoding='utf-8') as log:
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                            text=True, **kwargs)
    try:
      code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      code = None
  print(f'the job ran {time.monotonic() - started:.0f} s, {load()}')
  with open(log_path, encoding='utf-8') as log:
    return code, log.read()
