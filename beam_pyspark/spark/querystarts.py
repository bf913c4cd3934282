"""Starting a streaming job's query on a loaded machine, and what its
failure says.

Each start of a job's query (``spark.sources.Query``) makes Spark launch a
Python process of its own for the query's source
(``pyspark.sql.streaming.python_streaming_source_runner``), and Spark 4.3
waits a fixed 10 s for it to connect back: ``PythonWorkerFactory
.createSimpleWorker`` calls ``Selector.select(10000)``, a literal with no
setting (``spark.python.authenticate.socketTimeout`` governs only the
handshake after the connection; the daemon's workers get a fixed 60 s).
The process needs about 0.3 CPU-seconds to import PySpark before it
connects: at load 30-90 on 2 cores that took longer than 10 s, and three
restarts at once failed as the first did. Before a first micro-batch
nothing ran or was written, so the query is started again, after a
growing pause (the load passes, the job's Python workers finish starting
meanwhile), for up to ``START_BUDGET_SECS``.

A query's failure reaches the driver as Spark's ``StreamingQueryException``,
whose text is a dump of the query (offsets, "Current State", "Thread State:
RUNNABLE", its plan); ``failure_cause`` is its cause alone.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from typing import Callable
from typing import Iterator

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.spark.failures import spark_failure_message

NO_CONNECT_BACK = 'Python worker failed to connect back'

# How long a job keeps starting its query again while Spark's source
# process fails to connect back in time, and the pauses between starts.
START_BUDGET_SECS = 600
START_PAUSES_SECS = (2, 4, 8, 15, 30)

# How a StreamingQueryException's text starts: the cause follows.
_TERMINATED = re.compile(r'terminated with exception: (.*?)(?:\s*SQLSTATE: \w+)?$',
                         re.MULTILINE)
_JAVA_PREFIX = re.compile(r'^(?:org\.apache\.spark\.SparkException|'
                          r'java\.lang\.RuntimeException): ')


def failure_cause(exn: BaseException) -> str:
  """What made a Spark query (or call) fail: its causes' messages, the
  outermost first, without Spark's dump of the query; a Python error in
  the source its traceback."""
  causes = []
  cause = getattr(exn, '_cause', None)  # PySpark's CapturedException chain
  while cause is not None and len(causes) < 8:
    desc = (getattr(cause, '_desc', None) or '').strip()
    if 'Traceback (most recent call last)' in desc:
      causes.append(spark_failure_message(desc))
      break
    desc = _JAVA_PREFIX.sub('', desc)
    if desc and not any(desc in c or c in desc for c in causes):
      causes.append(desc)
    cause = getattr(cause, '_cause', None)
  if not causes:
    text = str(exn)
    found = _TERMINATED.search(text)
    causes.append(found.group(1) if found else spark_failure_message(
        text.split('\n=== Streaming Query ===')[0]).strip())
  return ' Caused by: '.join(causes)


def start_pauses(budget: float = START_BUDGET_SECS,
                 clock: Callable[[], float] = time.monotonic
                 ) -> Iterator[float]:
  """The pauses before each start after the first, until ``budget``
  seconds have passed since the first."""
  deadline = clock() + budget
  for i in itertools.count():
    pause = START_PAUSES_SECS[min(i, len(START_PAUSES_SECS) - 1)]
    if clock() + pause > deadline:
      return
    yield pause


def busy() -> bool:
  """Whether more processes wait for the CPU than it has cores."""
  try:
    return os.getloadavg()[0] > (os.cpu_count() or 1)
  except OSError:
    return False


def not_started(cause: str, starts: int, elapsed: float) -> str:
  """The error of a query that never got to its first micro-batch."""
  try:
    load = f'load {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores'
  except OSError:
    load = 'a loaded machine'
  if NO_CONNECT_BACK in cause:
    why = ('Spark launches a Python process for the query\'s source at each '
           'start and waits a fixed 10 s for it to connect back (Spark has '
           'no setting for it); it did not, each time: the machine is too '
           f'busy ({load}). Run the job when the machine is less loaded, on '
           'more cores, or with fewer jobs at once; a job given a '
           '--checkpoint_location resumes where it stopped.')
  else:
    why = f'({load})'
  return (f'The streaming query did not start: {cause}, {starts} times over '
          f'{elapsed:.0f} s. {why}')


def query_error(exn: BaseException, starts: int, elapsed: float,
                started: bool) -> PipelineExecutionError:
  """The job's error for its query's failure: that it never started, or
  that it failed, and why."""
  if not started:
    return PipelineExecutionError(
        not_started(failure_cause(exn), starts, elapsed))
  return PipelineExecutionError(
      f'The streaming query failed: {failure_cause(exn)}')
