"""What a streaming query's failure says (spark.querystarts), and the
pauses between its starts. PySpark's CapturedException chain is faked
here: a real one needs Spark's 10 s to pass (tests/test_checkpoint_hdfs.py
runs the real query on a busy machine)."""
from beam_pyspark.spark import querystarts


class _Captured(Exception):
  """PySpark's CapturedException, as far as failure_cause reads it."""
  def __init__(self, desc, cause=None):
    super().__init__(desc)
    self._desc, self._cause = desc, cause


# A StreamingQueryException's text as PySpark 4.3 gives it.
_DUMP = ('[STREAM_FAILED] Query [id = 1, runId = 2] terminated with '
         'exception: Python worker failed to connect back. SQLSTATE: XXKST\n'
         '=== Streaming Query ===\nCurrent State: INITIALIZING\n'
         'Thread State: RUNNABLE\n')


def test_the_cause_is_named_not_the_thread_state():
  exn = _Captured(_DUMP, _Captured(
      'org.apache.spark.SparkException: Python worker failed to connect '
      'back.', _Captured('java.net.SocketTimeoutException: Timed out while '
                         'waiting for the Python worker to connect back')))
  cause = querystarts.failure_cause(exn)
  assert cause.startswith('Python worker failed to connect back.'), cause
  assert 'SocketTimeoutException' in cause and 'RUNNABLE' not in cause
  error = str(querystarts.query_error(exn, 4, 95.0, started=False))
  assert 'did not start' in error and '4 times over 95 s' in error
  assert 'fixed 10 s' in error and 'Thread State' not in error


def test_the_cause_from_the_text_alone():
  assert querystarts.failure_cause(Exception(_DUMP)) == (
      'Python worker failed to connect back.')


def test_a_python_error_in_the_source_is_its_traceback():
  exn = _Captured(_DUMP, _Captured(
      'org.apache.spark.api.python.PythonException: Traceback (most recent '
      'call last):\n  File "x.py", line 1\nValueError: bad offset\n'))
  assert querystarts.failure_cause(exn).endswith('ValueError: bad offset')


def test_pauses_grow_and_stop_at_the_budget():
  now = [0.0]
  pauses = []
  for pause in querystarts.start_pauses(budget=100, clock=lambda: now[0]):
    pauses.append(pause)
    now[0] += pause + 10  # the start itself
  assert pauses == [2, 4, 8, 15, 30], pauses


class _Query:
  """PySpark's StreamingQuery, as far as Query._run_query reads it. The
  first query fails between two of the job's polls (Spark's 10 s for the
  source's process ran out); the second runs until the job is over."""
  def __init__(self, fails):
    self.fails, self.polls = fails, 0
    self.status = {'isTriggerActive': False}

  @property
  def isActive(self):  # pylint: disable=invalid-name
    return not self.fails or self.polls == 0

  def awaitTermination(self, timeout):  # pylint: disable=invalid-name
    self.polls += 1
    if self.fails and self.polls > 1:
      raise _Captured(_DUMP, _Captured(
          'org.apache.spark.SparkException: Python worker failed to '
          'connect back.'))
    return False

  def stop(self):
    pass


class _Reader:
  """readStream...load() -> writeStream...start(): one _Query a start."""
  def __init__(self, queries):
    self.queries, self.started = queries, []

  def load(self):
    return self

  @property
  def writeStream(self):  # pylint: disable=invalid-name
    return self

  def queryName(self, _):  # pylint: disable=invalid-name
    return self

  def foreachBatch(self, _):  # pylint: disable=invalid-name
    return self

  def option(self, *_):
    return self

  def start(self):
    self.started.append(self.queries.pop(0))
    return self.started[-1]


def test_a_query_that_fails_between_polls_is_started_again(
    tmp_path, monkeypatch):
  """Its failure was lost (the poll loop saw it inactive and left, the job
  ended DONE, nothing read) when the query failed after one poll and
  before the next: on a loaded machine, at load 30 on 2 cores."""
  from beam_pyspark.spark import sources
  monkeypatch.setattr(querystarts, 'START_PAUSES_SECS', (0,))
  query = object.__new__(sources.Query)
  logged = []
  first, second = _Query(fails=True), _Query(fails=False)
  query.job_id, query.root, query.location = 'job', str(tmp_path), ''
  query.finished = lambda: second.polls > 0
  query.stopping = lambda: False
  query.log, query._errors = logged.append, []
  query._started, query._warming = None, None
  reader = _Reader([first, second])
  query._run_starts(reader)
  assert reader.started == [first, second]
  assert len(logged) == 1 and 'Starting it again' in logged[0], logged
