"""One run of a pipeline on Spark: the engine behind the runner and the
job server alike.

``PipelineExecution`` validates and plans the pipeline, then runs it on a
background thread; it records its state history and messages, can be
cancelled, and holds the merged metrics when done.  The job service is
handed this (through an executor function) and never touches Spark itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import traceback
import uuid
from typing import Callable
from typing import Optional
from typing import Union

from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import JobCancelledError
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning import check_supported
from beam_pyspark.planning import plan_pipeline

_LOGGER = logging.getLogger(__name__)

def parse_level(value: Union[None, int, str], default: int = logging.INFO) -> int:
  """A logging level from Beam's ``--default_sdk_harness_log_level`` forms.

  Raises ValueError naming the accepted forms.
  """
  if value is None or value == '':
    return default
  if isinstance(value, int):
    return value
  text = str(value).strip()
  if text.lstrip('-').isdigit():
    return int(text)
  level = logging.getLevelName(text.upper())
  if isinstance(level, int):
    return level
  raise ValueError(
      f'Unknown log level {value!r}: use a level name (DEBUG, INFO, WARNING, '
      'ERROR, CRITICAL) or a number.')


JobState = beam_job_api_pb2.JobState
TERMINAL_STATES = frozenset([
    JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.DRAINED,
    JobState.UPDATED
])


@dataclasses.dataclass
class SparkSettings:
  master: Optional[str] = None  # None: the active context, else local[*]
  conf: dict = dataclasses.field(default_factory=dict)
  parallelism: Optional[int] = None
  # Plan the job drained (PySparkRunnerOptions.drain).
  drain: bool = False
  # Beam's --default_sdk_harness_log_level / --sdk_harness_log_level_overrides:
  # what executors forward of the logs written while stages run.
  log_level: int = logging.INFO
  log_overrides: Optional[dict] = None
  # The job's pipeline options as the Job API carries them, handed to SDK
  # harnesses that run in their own processes.
  job_options: Optional[dict] = None

  @classmethod
  def from_job_options(
      cls, options: dict, master: Optional[str] = None,
      conf: Optional[dict] = None) -> 'SparkSettings':
    """From a job's pipeline options as the Job API carries them
    (``beam:option:NAME:v1`` keys). Raises ValueError for a bad value."""
    def opt(name):
      return options.get(f'beam:option:{name}:v1')

    parallelism = opt('spark_parallelism')
    overrides = opt('sdk_harness_log_level_overrides')
    if isinstance(overrides, str):
      overrides = json.loads(overrides)
    return cls(
        master=master,
        conf=dict(conf or {}),
        parallelism=int(parallelism) if parallelism else None,
        drain=opt('drain') in (True, 'true', 'True'),
        log_level=parse_level(opt('default_sdk_harness_log_level')),
        log_overrides={k: parse_level(v) for k, v in (overrides or {}).items()}
        or None,
        job_options=dict(options))


@dataclasses.dataclass
class Message:
  timestamp: float
  importance: int  # beam_job_api_pb2.JobMessage.MessageImportance
  text: str


class PipelineExecution:
  def __init__(
      self,
      pipeline: beam_runner_api_pb2.Pipeline,
      settings: Optional[SparkSettings] = None,
      job_id: Optional[str] = None,
      listener: Optional[Callable[[object], None]] = None):
    self.pipeline = pipeline
    self.settings = settings or SparkSettings()
    self.job_id = job_id or 'job-' + uuid.uuid4().hex[:12]
    self._listener = listener
    self._lock = threading.Lock()
    self._done = threading.Condition(self._lock)
    self._state = JobState.STOPPED
    self.state_history: list[tuple[float, int]] = []
    self.messages: list[Message] = []
    self.error: Optional[str] = None
    self.committed_metrics = []
    self.attempted_metrics = []
    self._spark_job = None
    self._cancel_requested = False
    self._thread: Optional[threading.Thread] = None
    self._set_state(JobState.STOPPED)

  # -- lifecycle --------------------------------------------------------------

  def validate(self) -> None:
    """Raises UnsupportedPipelineError listing everything we cannot run."""
    check_supported(self.pipeline)

  def start(self) -> None:
    self.validate()
    self._set_state(JobState.STARTING)
    self._thread = threading.Thread(
        target=self._run, name=f'beam-pyspark-{self.job_id}', daemon=True)
    self._thread.start()

  def cancel(self) -> None:
    with self._lock:
      if self._state in TERMINAL_STATES:
        return
      self._cancel_requested = True
      spark_job = self._spark_job
    self._set_state(JobState.CANCELLING)
    if spark_job is not None:
      spark_job.cancel()

  def wait(self, timeout: Optional[float] = None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._done:
      while self._state not in TERMINAL_STATES:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          break
        self._done.wait(remaining)
      return self._state

  @property
  def state(self) -> int:
    with self._lock:
      return self._state

  # -- internals --------------------------------------------------------------

  def _set_state(self, state: int) -> None:
    with self._done:
      if self._state in TERMINAL_STATES:
        return
      if self.state_history and self._state == state:
        return
      self._state = state
      self.state_history.append((time.time(), state))
      self._done.notify_all()
    if self._listener:
      self._listener(('state', state))

  def message(self, text: str, importance: int = (
      beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_BASIC)) -> None:
    msg = Message(time.time(), importance, text)
    with self._lock:
      self.messages.append(msg)
    if self._listener:
      self._listener(('message', msg))

  def _run(self) -> None:
    from beam_pyspark.spark.session import spark_context
    from beam_pyspark.spark.translate import SparkJobOptions
    from beam_pyspark.spark.translate import SparkPipelineJob
    try:
      plan = plan_pipeline(self.pipeline, drain=self.settings.drain)
      sc = spark_context(self.settings.master, self.settings.conf)
      job = SparkPipelineJob(
          sc, plan, self.job_id,
          SparkJobOptions(
              parallelism=self.settings.parallelism,
              log_level=self.settings.log_level,
              log_overrides=self.settings.log_overrides,
              pipeline_options=self.settings.job_options),
          log=self.message)
      with self._lock:
        self._spark_job = job
        cancelled = self._cancel_requested
      if cancelled:
        raise JobCancelledError(self.job_id)
      self._set_state(JobState.RUNNING)
      self.message(
          f'Running job {self.job_id}: {len(plan.stages)} stages on '
          f'Spark {sc.master}')
      started = time.monotonic()
      try:
        job.run()
      finally:
        self.committed_metrics = job.metrics.committed()
        self.attempted_metrics = job.metrics.attempted()
      self.message(
          f'Job {self.job_id} finished in {time.monotonic() - started:.1f}s')
      self._set_state(JobState.DONE)
    except JobCancelledError:
      self.message(f'Job {self.job_id} was cancelled')
      self._set_state(JobState.CANCELLED)
    except PipelineExecutionError as exn:
      self._fail(str(exn))
    except Exception:  # pylint: disable=broad-except
      self._fail(traceback.format_exc())

  def _fail(self, error: str) -> None:
    if self._cancel_requested:
      self._set_state(JobState.CANCELLED)
      return
    self.error = error
    _LOGGER.error('Job %s failed: %s', self.job_id, error)
    self.message(
        error, beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_ERROR)
    self._set_state(JobState.FAILED)
