"""One run of a pipeline: the job lifecycle behind the runner and the job
server alike.

``PipelineExecution`` validates and plans the pipeline, chooses its engine
(``engine.py``: batch on Spark today) and runs it on a background thread;
it records its state history and messages, can be cancelled, and reports
the engine's metrics, live while the job runs.  The job service is handed
this (through an executor function) and never touches Spark itself.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import urllib.parse
import uuid
from typing import Callable
from typing import Optional

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.engine import OPTIONAL_METHODS
from beam_pyspark.engine import STREAMING
from beam_pyspark.engine import check_engine
from beam_pyspark.engine import checked_checkpoint_location
from beam_pyspark.engine import create_engine
from beam_pyspark.engine import over_connect
from beam_pyspark.errors import BeamPySparkError
from beam_pyspark.events import TERMINAL_STATES
from beam_pyspark.events import Event
from beam_pyspark.events import Importance
from beam_pyspark.events import JobState
from beam_pyspark.events import MessageEvent
from beam_pyspark.events import StateEvent
from beam_pyspark.errors import JobCancelledError
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.errors import out_of_memory
from beam_pyspark.errors import root_cause
from beam_pyspark.options import RunnerOptions
from beam_pyspark.planning import check_supported
from beam_pyspark.planning import plan_pipeline
from beam_pyspark.planning import relpaths
from beam_pyspark.planning.kafkaio import describe_kafka_failure
from beam_pyspark.planning.passthrough import without_pass_through_leaves
from beam_pyspark.planning.sdks import stages_by_environment

_LOGGER = logging.getLogger(__name__)

Listener = Callable[[Event], None]



def check_outputs(pipeline: beam_runner_api_pb2.Pipeline,
                  options: RunnerOptions) -> None:
  """Refuses file outputs and inputs named by a relative path where the
  tasks do not run in this process's directory (planning.relpaths)."""
  if over_connect(options):
    where = ("over Spark Connect the tasks run in the server's session "
             'directory')
  elif options.master and not options.master.startswith('local'):
    where = (f"on {options.master} the tasks run in each executor's "
             'working directory')
  else:
    return
  outputs = relpaths.relative_outputs(pipeline)
  inputs = relpaths.relative_inputs(pipeline)
  if outputs or inputs:
    raise UnsupportedPipelineError(relpaths.refusal(outputs, where, inputs))

class PipelineExecution:
  """Runs one job; reports its states and messages to ``listener``.

  It keeps no history (the job registry does): only its current state,
  which its own cancel and wait need, and the error it failed with.
  """
  def __init__(
      self,
      pipeline: beam_runner_api_pb2.Pipeline,
      options: Optional[RunnerOptions] = None,
      job_id: Optional[str] = None,
      listener: Optional[Listener] = None,
      status_url: Optional[Callable[[], Optional[str]]] = None):
    # Composites that expanded to nothing (Java's, in expanded transforms)
    # leave the tree first: validation and fusion see only what runs.
    self.pipeline = without_pass_through_leaves(pipeline)
    # The status page's base URL, if one serves this job.
    self._status_url = status_url or (lambda: None)
    self.options = options or RunnerOptions()
    self.job_id = job_id or 'job-' + uuid.uuid4().hex[:12]
    self._listener = listener
    self._lock = threading.Lock()
    self._done = threading.Condition(self._lock)
    # Prepared: whoever created the job recorded STOPPED already.
    self._state = JobState.STOPPED
    self.error: Optional[str] = None
    self._final_metrics: Optional[tuple[list, list]] = None
    # The engine's last progress and streaming status, kept when it ends.
    self._final_status: dict[str, Optional[dict]] = {}
    self._engine = None
    self.plan = None  # once planned
    self._cancel_requested = False
    # Why the job was stopped to resume later (interrupt()), if it was.
    self._interrupted: Optional[str] = None
    self._drain_requested = False
    self._over = False  # the run's thread is done (a STOPPED job ended)
    self._thread: Optional[threading.Thread] = None

  # -- lifecycle --------------------------------------------------------------

  def validate(self) -> None:
    """Raises UnsupportedPipelineError listing everything we cannot run,
    InvalidOptionsError for a checkpoint location it could not use."""
    check_supported(self.pipeline)
    kind = check_engine(self.pipeline, self.options)
    check_outputs(self.pipeline, self.options)
    if kind == STREAMING and self.options.checkpoint_location:
      self.options.checkpoint_location = checked_checkpoint_location(
          self.options.checkpoint_location, self.options.job_options)

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
      engine = self._engine
    self._set_state(JobState.CANCELLING)
    if engine is not None:
      engine.cancel()

  def drain(self) -> bool:
    """Drains a streaming job (the Job API's Drain): its reads stop at
    what their restrictions hold now (Beam's truncate), its watermarks go
    to +inf, every window fires, and it ends DRAINED. False, doing
    nothing, for a job that has nothing to drain (batch) or has ended."""
    if not self._is_streaming():
      return False
    with self._lock:
      if (self._state in TERMINAL_STATES or self._cancel_requested or
          self._drain_requested):
        return self._drain_requested
      self._drain_requested = True
      engine = self._engine
    self.message(f'Draining job {self.job_id}: its reads stop at what they '
                 'hold now, and its windows fire as its watermarks go to '
                 '+inf.')
    self._set_state(JobState.DRAINING)
    if engine is not None:
      self._start_drain(engine)
    return True

  def _is_streaming(self) -> bool:
    try:
      return check_engine(self.pipeline, self.options) == STREAMING
    except BeamPySparkError:
      return False

  def _start_drain(self, engine) -> None:
    engine.drain(plan_pipeline(self.pipeline, drain=True, streaming=True))

  def interrupt(self, reason: str,
                resume: str = 'it resumes from it when the job server '
                'starts again', graceful: bool = False) -> bool:
    """Stops a streaming job so that it can resume: between micro-batches
    (the engine's cancel; the batch it interrupts never committed, and runs
    again on resume), its checkpoint kept, since a location was given. It
    ends STOPPED (Beam's "paused or not yet started"), not CANCELLED.
    Returns False, doing nothing, for a job that could not resume (batch,
    or no checkpoint location): cancel that instead. ``graceful``: the
    running micro-batch finishes and commits first (the engine's ``stop``),
    rather than failing at its next Spark action."""
    if not self.options.checkpoint_location or not self._is_streaming():
      return False
    with self._lock:
      if self._state in TERMINAL_STATES or self._cancel_requested:
        return False
      self._cancel_requested = True
      self._interrupted = reason
      engine = self._engine
    self.message(
        f'{reason}: stopping this streaming job between micro-batches; its '
        f'checkpoint ({self.options.checkpoint_location}) is kept, and '
        f'{resume}.',
        Importance.JOB_MESSAGE_WARNING)
    if engine is not None:
      if graceful and hasattr(engine, 'stop'):
        engine.stop()
      else:
        engine.cancel()
    return True

  def wait(self, timeout: Optional[float] = None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._done:
      while self._state not in TERMINAL_STATES and not self._over:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          break
        self._done.wait(remaining)
      return self._state

  @property
  def committed_metrics(self) -> list:
    """The job's committed metrics: so far while it runs, final after."""
    return self._metrics()[0]

  @property
  def attempted_metrics(self) -> list:
    return self._metrics()[1]

  def _metrics(self) -> tuple[list, list]:
    with self._lock:
      final, engine = self._final_metrics, self._engine
    if final is not None:
      return final
    return engine.metrics() if engine is not None else ([], [])

  def links(self) -> str:
    """Where to watch the job: its status page and the Spark UI, as far
    as they are known ('' if neither is)."""
    links = []
    base = self._status_url()
    if base:
      page = urllib.parse.quote(self.job_id, safe='')
      links.append(f'status page {base.rstrip("/")}/jobs/{page}')
    try:
      ui = (self.progress() or {}).get('spark_ui')
    except Exception:  # pylint: disable=broad-except
      ui = None  # no progress, no UI: the links are a courtesy
    if ui:
      links.append(f'Spark UI {ui}')
    return ', '.join(links)

  def progress(self) -> Optional[dict]:
    """The engine's progress (engine.OPTIONAL_METHODS): live while the job
    runs, its last one after; None if the engine reports none."""
    return self._engine_status('progress')

  def streaming_status(self) -> Optional[dict]:
    """A streaming engine's own status, if it offers one."""
    return self._engine_status('streaming_status')

  def _engine_status(self, name: str) -> Optional[dict]:
    with self._lock:
      if name in self._final_status:
        return self._final_status[name]
      engine = self._engine
    method = getattr(engine, name, None)
    return method() if method is not None else None

  @property
  def state(self) -> int:
    with self._lock:
      return self._state

  # -- internals --------------------------------------------------------------

  def _set_state(self, state: int) -> None:
    with self._done:
      if self._state in TERMINAL_STATES or self._state == state:
        return
      self._state = state
      self._done.notify_all()
    if self._listener:
      self._listener(StateEvent(time.time(), state))

  def message(self, text: str,
              importance: int = Importance.JOB_MESSAGE_BASIC) -> None:
    if self._listener:
      self._listener(MessageEvent(time.time(), importance, text))

  def _run(self) -> None:
    try:
      self._run_engine()
    finally:
      with self._done:
        self._over = True
        self._done.notify_all()

  def _run_engine(self) -> None:
    engine = None
    try:
      kind = check_engine(self.pipeline, self.options)
      plan = plan_pipeline(self.pipeline, drain=self.options.drain,
                           streaming=kind == STREAMING)
      self.plan = plan
      engine = create_engine(kind, plan, self.job_id, self.options,
                             self.message)
      with self._lock:
        self._engine = engine
        cancelled = self._cancel_requested
        draining = self._drain_requested
      if cancelled:
        raise JobCancelledError(self.job_id)
      if draining:  # asked before the engine was there
        self._start_drain(engine)
      else:
        self._set_state(JobState.RUNNING)
      self.message(
          f'Running job {self.job_id}: {len(plan.stages)} stages on '
          f'{engine.describe()}; {stages_by_environment(plan)}')
      links = self.links()
      if links:
        # One line where the job runs (the job server's log) and in the
        # job's messages, which Beam's clients show.
        _LOGGER.info('Job %s: %s', self.job_id, links)
        self.message(f'Job {self.job_id}: {links}')
      started = time.monotonic()
      try:
        engine.run()
      finally:
        final = engine.metrics()
        status = {}
        for name in OPTIONAL_METHODS:
          try:
            status[name] = self._engine_status(name)
          except Exception:  # pylint: disable=broad-except
            # A context stopped under the job: its status is lost, not
            # the job's end.
            _LOGGER.debug('No %s for %s', name, self.job_id, exc_info=True)
        with self._lock:
          self._final_metrics = final
          self._final_status = status
      self.message(
          f'Job {self.job_id} finished in {time.monotonic() - started:.1f}s')
      self._set_state(
          JobState.DRAINED if self._drain_requested else JobState.DONE)
    except JobCancelledError:
      self._cancelled()
    except PipelineExecutionError as exn:
      self._fail(str(exn))
    except BeamPySparkError as exn:  # ours, and says what to do: no traceback
      self._fail(str(exn))
    except Exception:  # pylint: disable=broad-except
      self._fail(traceback.format_exc())

  def _cancelled(self) -> None:
    if self._interrupted:
      self.message(f'Job {self.job_id} stopped, to resume from its checkpoint '
                   f'({self._interrupted})')
      self._set_state(JobState.STOPPED)
    else:
      self.message(f'Job {self.job_id} was cancelled')
      self._set_state(JobState.CANCELLED)

  def _fail(self, error: str) -> None:
    if self._interrupted:
      self._cancelled()
      return
    if self._cancel_requested:
      self._set_state(JobState.CANCELLED)
      return
    # Running out of memory says so first, wherever the sign was buried.
    oom = out_of_memory(error)
    if oom is not None and not error.startswith(oom):
      error = f'{oom}\n\n{error}'
    # A Kafka error names neither topic nor broker: the read's config does.
    kafka = describe_kafka_failure(error, self.pipeline)
    if kafka:
      error = f'{kafka}\n\n{error}'
    self.error = error
    # One line here: the whole error (the user's traceback) is the job's
    # message, and what the runner raises.
    _LOGGER.error('Job %s failed: %s', self.job_id, oom or root_cause(error))
    self.message(error, Importance.JOB_MESSAGE_ERROR)
    self._set_state(JobState.FAILED)
