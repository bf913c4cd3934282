"""The Spark Connect engine: an ExecutionPlan as DataFrame jobs over Spark
Connect (engine.ENGINES['connect']), for endpoints with no SparkContext,
RDDs or py4j (Databricks serverless and standard access modes, a
cluster's Connect server, a client with only ``pyspark-client``).

What the RDD engine gets from py4j, here:

* metrics and logs: each task's reports travel as REPORT rows
  (connect.tasks) with the data, and the client collects them with the
  job's last action (one action over the stages nothing reads, keeping
  only those rows) and with every collect of a side input or of sizes;
  a report read twice (an output persisted for two consumers) counts once
* cancel: every Spark job of a Beam job carries a tag (``addTag``);
  ``cancel`` interrupts them (``interruptTag``)
* parallelism: ``--spark_parallelism``, else what the server gives a
  ``range`` (its default parallelism), asked once per session
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import threading
from typing import Callable
from typing import Optional

from beam_pyspark.connect import tasks
from beam_pyspark.connect.liveness import abandon
from beam_pyspark.connect.liveness import lost_server_message
from beam_pyspark.connect.session import connect_session
from beam_pyspark.connect.translate import StageTranslator
from beam_pyspark.connect.translate import collect_rows
from beam_pyspark.errors import JobCancelledError
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.messages import forwarded
from beam_pyspark.metrics import TaskMetrics
from beam_pyspark.options import RunnerOptions
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.spark.dependencies import ship_dependencies
from beam_pyspark.spark.failures import spark_failure_message
from beam_pyspark.worker import fastpath
from beam_pyspark.worker import harnesses
from beam_pyspark.worker.runtime import JobRuntime

_LOGGER = logging.getLogger(__name__)

# The group budget when --group_memory_mb is unset: half of PySpark's
# default spark.python.worker.memory (512m), as the RDD engine's default.
DEFAULT_GROUP_MB = 256
# The Arrow batches that reach a task's Python: about one ~1 MiB chunk
# each (by bytes), so that the task's Python works on one chunk while the
# JVM writes the next into the socket; with 16 chunks a batch, Python sat
# waiting for each whole batch to arrive (GroupByKey at 200 MiB: its
# Python workers slept 16% of the time, against 3% on the RDD engine). At
# most 16 rows: a server without maxBytesPerBatch (before Spark 4) would
# otherwise put up to 10000 chunks, gigabytes, in one batch.
SESSION_CONF = {
    'spark.sql.execution.arrow.maxRecordsPerBatch': '16',
    'spark.sql.execution.arrow.maxBytesPerBatch': str(1 << 20),
}

_parallelism_lock = threading.Lock()
_parallelism: dict[str, int] = {}
# Per session: [jobs running, the SESSION_CONF values it had before them].
_session_conf: dict[str, list] = {}


def create_connect_engine(plan: ExecutionPlan, job_id: str,
                          options: RunnerOptions,
                          log: Callable[..., None]) -> 'ConnectPipelineJob':
  """The Connect engine (engine.ENGINES): the plan on the Connect session
  of ``--spark_remote`` / SPARK_REMOTE / the program's own."""
  spark = connect_session(options.remote)
  return ConnectPipelineJob(spark, plan, job_id, options, log)


def warm_up(remote: Optional[str]) -> None:
  """The Connect session made, and the server's parallelism asked
  (engine.warm_up: a job server does this at start)."""
  default_parallelism(connect_session(remote))


def default_parallelism(spark) -> int:
  """The server's default parallelism: the partitions of a ``range``."""
  key = spark.session_id
  with _parallelism_lock:
    if key not in _parallelism:
      from pyspark.sql.connect import functions as f
      (row,) = spark.range(0, 1 << 12).select(
          f.spark_partition_id().alias('p')).agg(
              f.max('p').alias('p')).collect()
      _parallelism[key] = (row.p or 0) + 1
    return _parallelism[key]


class ConnectPipelineJob(StageTranslator):
  """Runs one plan over one Connect session as a batch job (an
  engine.Engine); cancellable, and its metrics readable, from another
  thread."""
  def __init__(self, spark, plan: ExecutionPlan, job_id: str,
               options: Optional[RunnerOptions] = None,
               log: Optional[Callable[..., None]] = None):
    self.spark = spark
    self.plan = plan
    self.job_id = job_id
    self.options = options or RunnerOptions()
    self.log = log or (lambda text, *_: _LOGGER.info('%s', text))
    self.tag = f'beam-{job_id}'
    self._cancelled = threading.Event()
    self._runtime = JobRuntime(job_id, plan.components)
    self._parallelism = self.options.parallelism or max(
        2, default_parallelism(spark))
    self._consumers = plan.consumers()
    self._producers = plan.producers()
    self._producer_frames: dict[bytes, list] = {}
    self._buffer_frames: dict[bytes, object] = {}
    self._side_chunks: dict[bytes, list[bytes]] = {}
    self._persisted: list = []
    self._side_buffer_ids = {
        si.buffer_id for s in plan.stages for si in s.side_inputs}
    self._group_budget = (
        self.options.group_memory_mb or DEFAULT_GROUP_MB) << 20
    self._fast, self._fast_note = (
        fastpath.choose(plan.stages, self._runtime)
        if self.options.fast_path else ({}, ''))
    self._reports: set[bytes] = set()
    self._metrics = TaskMetrics()
    self._lock = threading.Lock()
    self._succeeded = False
    self._shipment = None
    self._tasks = TaskProgress()
    self._ctx = tasks.ConnectTaskContext(
        job_id=job_id,
        components=plan.components,
        bundle_bytes=self.options.bundle_bytes,
        python_path=_local_paths(spark),
        log_level=self.options.log_level,
        log_overrides=self.options.log_overrides,
        pipeline_options=self.options.job_options,
        split_after_secs=self.options.split_stragglers_after_secs,
        worker_console_logs=False)

  # -- engine.Engine --------------------------------------------------------

  def run(self) -> None:
    self.spark.addTag(self.tag)
    self._session_settings(True)
    with contextlib.suppress(Exception):
      self.spark.registerProgressHandler(self._tasks)
    lost = None
    try:
      self._ship_dependencies()
      self._execute()
      self._succeeded = True
    except Exception as exn:
      # A server that is gone: say so, naming it, and clean up only what
      # this client holds (each call to the server would be retried).
      lost = (None if self._cancelled.is_set() else
              lost_server_message(self.spark, exn))
      if lost:
        abandon(self.spark)
        raise PipelineExecutionError(lost) from exn
      raise
    finally:
      with contextlib.suppress(Exception):
        self.spark.removeProgressHandler(self._tasks)
      self._session_settings(False, server=not lost)
      self.spark.removeTag(self.tag)
      self._close(server=not lost)

  def cancel(self) -> None:
    self._cancelled.set()
    with contextlib.suppress(Exception):
      self.spark.interruptTag(self.tag)

  def metrics(self) -> tuple[list, list]:
    with self._lock:
      return self._metrics.committed(), self._metrics.attempted()

  def describe(self) -> str:
    return f'Spark Connect {self.options.remote or "session"}'

  def progress(self) -> dict:
    """Spark tasks of the job's operations (the session's progress
    reports), and per fused stage the tasks that reported so far."""
    progress = self._tasks.snapshot()
    with self._lock:
      progress['beam_stages'] = self._metrics.tasks_done()
    return progress

  # -- the job --------------------------------------------------------------

  def _execute(self) -> None:
    if self._fast_note:
      self.log(self._fast_note)
    terminal = []
    for stage in self.plan.stages:
      self._check_cancelled()
      out = self._translate(stage)
      if out is not None and not any(
          self._consumers.get(b) for b in stage.outputs.values()):
        terminal.append(out)
    self._check_cancelled()
    if terminal:
      from pyspark.sql.connect import functions as f
      reports = self._union(terminal).filter(f.col('tag') == tasks.REPORT)
      self._reports_from(self._action(lambda: collect_rows(reports),
                                      'its outputs'))

  def _session_settings(self, starting: bool, server: bool = True) -> None:
    """The session has SESSION_CONF while jobs run on it: set by the first
    to start, what it had put back by the last to end (jobs of a job
    server share its session). ``server``: False when it is gone (only
    the count is kept)."""
    key = self.spark.session_id
    conf = self.spark.conf
    with _parallelism_lock:
      entry = _session_conf.setdefault(key, [0, {}])
      entry[0] += 1 if starting else -1
      if starting and entry[0] == 1:
        for name, value in SESSION_CONF.items():
          # A setting the endpoint refuses is left as it is.
          with _logged(f'Could not set {name}'):
            previous = conf.get(name, None)
            conf.set(name, value)
            entry[1][name] = previous
      elif not starting and entry[0] == 0:
        del _session_conf[key]
        for name, value in (entry[1] if server else {}).items():
          with _logged(f'Could not restore {name}'):
            if value is None:
              conf.unset(name)
            else:
              conf.set(name, value)

  def _ship_dependencies(self) -> None:
    """The job's staged files, served by this client to the server's
    executors (which must reach it: on another host, this host's name)."""
    local = _loopback(self.spark)
    address = (('127.0.0.1', '127.0.0.1', 0) if local else
               ('0.0.0.0', socket.getfqdn(), 0))
    self._shipment = ship_dependencies(None, self.plan, self.log, address)
    if self._shipment is not None:
      self._ctx.dependencies = self._shipment.shipped

  def _close(self, server: bool = True) -> None:
    """Ends what the job holds; ``server``: False when the server is
    gone (its cached frames and harnesses went with it)."""
    if self._shipment is not None:
      self._shipment.close()
    if not server:
      self._persisted = []
      return
    for df in self._persisted:
      with contextlib.suppress(Exception):
        df.unpersist()
    self._persisted = []
    self._release_harnesses()

  def _release_harnesses(self) -> None:
    """Best effort, as the RDD engine's spark.release: a task per Python
    worker slot stops the job's harnesses there; in the background unless
    one of the job's harnesses is a process this runner started
    (harnesses.release_waits)."""
    slots = 2 * self._parallelism
    spark, job_id, succeeded = self.spark, self.job_id, self._succeeded

    def release():
      try:
        spark.range(0, slots, 1, slots).mapInArrow(
            tasks.ArrowRelease(job_id, succeeded), tasks.rows_type()).collect()
      except Exception:  # pylint: disable=broad-except
        _LOGGER.debug('Could not release the harnesses of %s', job_id,
                      exc_info=True)

    if not harnesses.release_waits(self._runtime.components, self.plan):
      threading.Thread(target=release, name=f'release-{job_id}',
                       daemon=True).start()
    else:
      release()

  # -- actions and reports --------------------------------------------------

  def _check_cancelled(self) -> None:
    if self._cancelled.is_set():
      raise JobCancelledError(f'job {self.job_id} was cancelled')

  def _action(self, fn, what: str = ''):
    """Runs ``fn``'s Spark jobs under the job's tag; a failure says the
    user's traceback."""
    self._check_cancelled()
    try:
      return fn()
    except Exception as exn:
      if self._cancelled.is_set():
        raise JobCancelledError(f'job {self.job_id} was cancelled') from exn
      raise PipelineExecutionError(
          spark_failure_message(exn) +
          (f'\n(while computing {what})' if what else '')) from exn

  def _reports_from(self, rows: list) -> list:
    """``rows`` without their REPORT rows, which are taken in: metrics
    (each task's once) and logs (sent to the job's messages)."""
    kept = []
    for row in rows:
      if row.tag != tasks.REPORT:
        kept.append(row)
        continue
      if row.data in self._reports:
        continue
      self._reports.add(row.data)
      kind, _, entries = pickle.loads(row.data)
      if kind == 'metrics':
        with self._lock:
          self._metrics.add(entries)
      else:
        for _, level, text in sorted(entries, key=lambda e: e[0]):
          importance, text = forwarded(level, text)
          self.log(text, importance)
    return kept


class TaskProgress:
  """A Connect session's progress handler (``registerProgressHandler``):
  the Spark tasks of each operation's stages, summed over operations.
  (The session's handlers hear every operation of the client: jobs sharing
  one session count each other's tasks.)"""
  def __init__(self):
    self._lock = threading.Lock()
    self._stages: dict = {}  # (operation, stage) -> (tasks, completed)
    self._inflight: dict = {}  # operation -> tasks running

  def __call__(self, stages, inflight_tasks, operation_id, done) -> None:
    with self._lock:
      for stage in stages or ():
        self._stages[(operation_id, stage.stage_id)] = (
            stage.num_tasks, stage.num_completed_tasks)
      self._inflight[operation_id] = 0 if done else inflight_tasks

  def snapshot(self) -> dict:
    with self._lock:
      total = sum(t for t, _ in self._stages.values())
      finished = sum(c for _, c in self._stages.values())
      active = sum(self._inflight.values())
    if not total:
      return {}
    return {'tasks_total': total, 'tasks_done': finished,
            'tasks_active': active}


@contextlib.contextmanager
def _logged(what: str):
  """Any error of the block logged at debug level, not raised."""
  try:
    yield
  except Exception:  # pylint: disable=broad-except
    _LOGGER.debug('%s', what, exc_info=True)


def _loopback(spark) -> bool:
  """Whether the Connect server is on this machine's loopback."""
  builder = getattr(spark.client, '_builder', None) or getattr(
      spark.client, '_channel_builder', None)
  host = getattr(builder, 'host', None)
  return host in ('localhost', '127.0.0.1', '::1')


def _local_paths(spark) -> list[str]:
  """The client's import path, for a server on this machine (its Python
  workers then import the user's modules as the client does)."""
  from beam_pyspark.spark.session import driver_python_path
  if not _loopback(spark):
    return []
  path = driver_python_path()
  return [p for p in path.split(os.pathsep) if p] if path else []

