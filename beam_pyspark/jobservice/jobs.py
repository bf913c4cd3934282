"""The one owner of job state: live and past jobs, their events, history.

``JobRegistry`` holds every job the service knows: prepared, running, and
finished ones from this process or from the store (so history survives a
restart). It keeps each job's typed state and message events, serves them
to subscribers (history, then live events; streams.py reads them), bounds
the history and evicts what falls out of it (with its staged artifacts,
through a callback), and writes through to the store. Across restarts of
the server, streaming jobs stop at SIGTERM and resume at the next start
from their checkpoints (``recovery``, recovery.py; restarts.py). The executor is
injected (``invoke``), so the registry and the Job API over it run with a
fake in tests; the gRPC servicer (service.py) and the status page are thin
adapters over it. No gRPC and no Spark here.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from typing import Callable
from typing import Iterator
from typing import Optional

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.events import Event
from beam_pyspark.events import Importance
from beam_pyspark.events import JobState
from beam_pyspark.events import MessageEvent
from beam_pyspark.events import StateEvent
from beam_pyspark.events import state_name
from beam_pyspark.jobservice import streams
from beam_pyspark.jobservice.records import Job
from beam_pyspark.jobservice.records import JobSnapshot
from beam_pyspark.jobservice.records import JobStateError
from beam_pyspark.jobservice.records import ShuttingDownError
from beam_pyspark.jobservice.records import TooManyPreparationsError
from beam_pyspark.jobservice.records import UnknownJobError
from beam_pyspark.jobservice.recovery import Resume
from beam_pyspark.jobservice.recovery import StreamingRecovery
from beam_pyspark.jobservice.restarts import Restarts
from beam_pyspark.jobservice.store import JobRecord
from beam_pyspark.jobservice.store import JobStore

_LOGGER = logging.getLogger(__name__)

# Ended jobs kept (their records, messages and staged artifacts): the
# history bound. Jobs not ended yet never count against it.
DEFAULT_MAX_INVOCATION_HISTORY = 10
# Preparations not run yet, at most: a bound of their own, so that clients
# preparing at once never push each other's preparations out (twenty
# concurrent clients against a history of ten lost a job that way). Past
# it, Prepare is refused; a preparation itself ends only when it is run,
# cancelled, or expires.
DEFAULT_MAX_PREPARATIONS = 64
# Preparations one client (its host, as gRPC sees the peer) may keep at
# once, by default: one client filling every slot locked the others out
# until its preparations expired. Half, not less: clients behind one proxy
# or NAT, or many on one machine (twenty concurrent ones in the tests),
# share a host.
def default_preparations_per_client(max_preparations: int) -> int:
  return max(1, max_preparations // 2)

# A preparation not run within this long is expired (as Beam's Java job
# service times out staging): it ends FAILED, saying so, and joins the
# history like any ended job.
DEFAULT_PREPARATION_TIMEOUT_SECS = 1800.0
# Beam's clients send short names ('job', or the user's --job_name).
MAX_JOB_NAME_CHARS = 256

# invoke(job_id, pipeline, options, listener) -> an execution with start(),
# cancel(), committed_metrics and attempted_metrics.
# What an execution may report besides its metrics (engine.OPTIONAL_METHODS).
_STATUS_METHODS = ('progress', 'streaming_status')


def _call(execution, name: str) -> Optional[dict]:
  """execution.name() if it has it; a failure to report is no answer."""
  method = getattr(execution, name, None)
  if method is None:
    return None
  try:
    return method()
  except Exception:  # pylint: disable=broad-except
    _LOGGER.debug('No %s from %r', name, execution, exc_info=True)
    return None


Invoke = Callable[[str, beam_runner_api_pb2.Pipeline, dict,
                   Callable[[Event], None]], object]


class JobRegistry(Restarts):
  def __init__(
      self,
      invoke: Invoke,
      store: Optional[JobStore] = None,
      max_invocation_history: int = DEFAULT_MAX_INVOCATION_HISTORY,
      on_evict: Optional[Callable[[str], None]] = None,
      clock: Callable[[], float] = time.time,
      preparation_timeout_secs: float = DEFAULT_PREPARATION_TIMEOUT_SECS,
      recovery: Optional[StreamingRecovery] = None,
      max_preparations: int = DEFAULT_MAX_PREPARATIONS,
      max_preparations_per_client: Optional[int] = None):
    self._invoke = invoke
    self._max_preparations = max_preparations
    self._max_per_client = (
        max_preparations_per_client or
        default_preparations_per_client(max_preparations))
    # None: every job left unfinished by an earlier run ends FAILED.
    self._recovery = recovery
    self._preparation_timeout = preparation_timeout_secs
    self._store = store or JobStore()
    self._max_history = max_invocation_history
    self._on_evict = on_evict
    self._clock = clock
    self._cond = threading.Condition()
    self._jobs: dict[str, Job] = {}
    # Ended jobs, oldest first: what the history bound evicts.
    self._finished: collections.deque[str] = collections.deque()
    self._closing = False
    # Jobs of an earlier run waiting to be run again (resume()).
    self._resumable: dict[str, Resume] = {}
    self._recover()

  # -- writing ------------------------------------------------------------

  def _append_state(self, job: Job, event: StateEvent) -> bool:
    """Records a state change (caller holds the condition, or is alone)."""
    if job.states and (job.states[-1].state == event.state or job.terminal):
      return False
    job.states.append(event)
    self._append_event(job, event)
    self._store.add_state(job.job_id, event.timestamp, event.state)
    return True

  def _append_message(self, job: Job, event: MessageEvent) -> None:
    self._append_event(job, event)
    self._store.add_message(job.job_id, event.timestamp, event.importance,
                            event.text)

  @staticmethod
  def _append_event(job: Job, event: Event) -> None:
    if len(job.events) == job.events.maxlen:
      job.dropped_events += 1
    job.events.append(event)

  def _listener(self, job_id: str) -> Callable[[Event], None]:
    with self._cond:
      generation = self._get(job_id).generation

    def on_event(event: Event) -> None:
      ended, dropped = False, []
      with self._cond:
        job = self._jobs.get(job_id)
        # An execution the registry let go of (a new run, _detach) says
        # no more.
        if job is None or job.generation != generation:
          return
        if isinstance(event, StateEvent):
          ended = self._append_state(job, event) and job.terminal
          dropped = self._into_history(job_id) if ended else []
        else:
          self._append_message(job, event)
        self._cond.notify_all()
      if ended:
        self._job_ended(job_id, dropped)
    return on_event

  # -- the lifecycle --------------------------------------------------------

  def prepare(self, job_name: str, pipeline: beam_runner_api_pb2.Pipeline,
              options: dict, job_id: Optional[str] = None,
              client: str = '') -> JobSnapshot:
    """A new job, prepared (STOPPED) until it is run, cancelled or expires.

    Its id is ``job_id`` if given (unique), else the name and a UUID.
    Raises ValueError for a name longer than MAX_JOB_NAME_CHARS, and
    TooManyPreparationsError when ``max_preparations`` wait already, or
    ``max_preparations_per_client`` of ``client`` (a peer's host; '' is
    no one's and counts only against the whole)."""
    if self._closing:
      raise ShuttingDownError(
          'The job server is stopping and takes no new jobs; submit the job '
          'again once it has restarted.')
    if len(job_name) > MAX_JOB_NAME_CHARS:
      raise ValueError(
          f'The job name is {len(job_name)} characters long; at most '
          f'{MAX_JOB_NAME_CHARS} are accepted. Give a shorter --job_name.')
    self.expire_preparations()
    job_id = job_id or f'{job_name}_{uuid.uuid4()}'
    job = Job(job_id, job_name, options, self._clock(), f'token-{job_id}',
               pipeline=pipeline)
    with self._cond:
      # Checked and taken under the lock: concurrent Prepares never pass
      # the bound together.
      waiting = len(self._preparations())
      if waiting >= self._max_preparations:
        raise TooManyPreparationsError(
            f'{waiting} prepared jobs wait to be run, the most this job '
            f'server keeps (--max-preparations {self._max_preparations}); '
            'run or cancel them, or wait: a preparation not run within '
            f'{self._preparation_timeout:.0f} s expires '
            '(--preparation-timeout-secs).')
      if client:
        own = sum(1 for j in self._preparations() if j.client == client)
        if own >= self._max_per_client:
          raise TooManyPreparationsError(
              f'{own} prepared jobs of client {client} wait to be run, the '
              'most one client may keep (--max-preparations-per-client '
              f'{self._max_per_client}); run or cancel them, or wait: a '
              'preparation not run within '
              f'{self._preparation_timeout:.0f} s expires.')
      job.client = client
      self._store.put_job(
          JobRecord(job_id=job_id, job_name=job_name, options=options,
                    created=job.created, staging_token=job.staging_token,
                    pipeline=pipeline.SerializeToString()))
      self._jobs[job_id] = job
      self._append_state(job, StateEvent(job.created, JobState.STOPPED))
      self._cond.notify_all()
      snapshot = job.snapshot()
    return snapshot

  def _preparations(self) -> list[Job]:
    """Prepared jobs not run (nor cancelled) yet, oldest first (caller
    holds the condition)."""
    return sorted((j for j in self._jobs.values()
                   if not j.has_run and not j.terminal),
                  key=lambda j: j.created)

  def expire_preparations(self) -> None:
    """Ends preparations not run within the preparation timeout."""
    deadline = self._clock() - self._preparation_timeout
    with self._cond:
      stale = [j for j in self._preparations() if j.created < deadline]
    for job in stale:
      self._expire(job, f'This preparation expired: it was not run within '
                   f'{self._preparation_timeout:.0f} s.')

  def _expire(self, job: Job, why: str) -> None:
    if not job.has_run:
      self._end(job, JobState.FAILED, why)

  def run(self, job_id: str,
          pipeline: Optional[beam_runner_api_pb2.Pipeline] = None,
          invoke: Optional[Invoke] = None) -> None:
    """Starts the prepared job (with ``pipeline``, e.g. its artifacts
    resolved, else the prepared one). Raises JobStateError if it ran or
    ended already, and what the executor raises (ValueError for an option
    it cannot honour, UnsupportedPipelineError) with nothing started.
    ``invoke`` replaces the registry's executor for this job."""
    with self._cond:
      job = self._get(job_id)
      if self._closing:
        raise ShuttingDownError(
            f'The job server is stopping and runs no new jobs; prepare and '
            f'run {job_id!r} again once it has restarted.')
      if job.has_run:
        raise JobStateError(f'Job {job_id!r} was already run.')
      if job.terminal:
        raise JobStateError(
            f'Job {job_id!r} is {JobState.Enum.Name(job.state)}: a '
            'preparation that was cancelled cannot be run; prepare it again.')
      job.has_run = True
    try:
      execution = (invoke or self._invoke)(
          job_id, pipeline or job.pipeline, job.options,
          self._listener(job_id))
      with self._cond:
        job.execution = execution
      execution.start()
    except BaseException:
      with self._cond:
        job.has_run = job.execution is not None and job.state != JobState.STOPPED
        job.execution = None
      raise

  def note(self, job_id: str, text: str,
           importance: int = Importance.JOB_MESSAGE_WARNING) -> None:
    """A message of the service's own about the job (e.g. ignored options)."""
    with self._cond:
      self._append_message(self._get(job_id),
                           MessageEvent(self._clock(), importance, text))
      self._cond.notify_all()

  def drain(self, job_id: str) -> int:
    """Drains a running streaming job (its state: DRAINING, then DRAINED);
    refuses (JobStateError) a job with nothing to drain."""
    with self._cond:
      job = self._get(job_id)
      execution = job.execution
    if job.terminal or execution is None:
      raise JobStateError(f'Job {job_id} cannot be drained: it is '
                          f'{state_name(job.state)}, not running.')
    if not execution.drain():
      raise JobStateError(
          f'Job {job_id} cannot be drained: only a streaming job reads '
          'sources that drain; cancel it instead.')
    with self._cond:
      return job.state

  def cancel(self, job_id: str) -> int:
    """Cancels a prepared or running job; returns its state."""
    with self._cond:
      job = self._get(job_id)
      execution = job.execution
      if execution is None and not job.terminal:
        ended = self._append_state(
            job, StateEvent(self._clock(), JobState.CANCELLED))
        dropped = self._into_history(job_id) if ended else []
        self._cond.notify_all()
      else:
        ended = False
    if ended:
      self._job_ended(job_id, dropped)
    elif execution is not None and not job.terminal:
      execution.cancel()
    with self._cond:
      return job.state

  def _end(self, job: Job, state: int, why: str) -> None:
    """Ends a job here, with its reason in its messages."""
    with self._cond:
      if job.terminal:
        return
      self._append_message(job, MessageEvent(
          self._clock(), Importance.JOB_MESSAGE_ERROR, why))
      ended = self._append_state(job, StateEvent(self._clock(), state))
      dropped = self._into_history(job.job_id) if ended else []
      self._cond.notify_all()
    if ended:
      self._job_ended(job.job_id, dropped)

  def _into_history(self, job_id: str) -> list[tuple[str, Optional[str]]]:
    """An ended job joins the history in the same hold of the lock as its
    terminal state (a listing between the two showed eleven jobs in a
    history of ten); what falls out of it, for ``_job_ended`` to evict."""
    self._finished.append(job_id)
    return self._trim()

  def _job_ended(self, job_id: str,
                 dropped: list[tuple[str, Optional[str]]]) -> None:
    """Records its final metrics; evicts what left the history."""
    try:
      self._record_final(job_id)
    finally:
      self._evict(dropped)

  def _record_final(self, job_id: str) -> None:
    with self._cond:
      job = self._jobs.get(job_id)
      if job is None:
        return
      execution = job.execution
    if execution is not None:
      metrics = list(getattr(execution, 'committed_metrics', []) or [])
      serialized = [m.SerializeToString() for m in metrics]
      self._store.set_metrics(job_id, serialized)
      # Kept in memory only: Spark forgets old jobs' stages, the page
      # should not; after a restart a past job shows no progress.
      status = {name: _call(execution, name) for name in _STATUS_METHODS}
      with self._cond:
        job.final_metrics = serialized
        job.final_status = status

  def _trim(self) -> list[tuple[str, Optional[str]]]:
    """Drops the oldest ended jobs past the history bound (caller holds the
    lock, or is alone); returns (job id, staging token) of each. Only ended
    jobs count: preparations and running jobs are never dropped."""
    dropped = []
    while self._finished and len(self._finished) > self._max_history:
      job_id = self._finished.popleft()
      job = self._jobs.pop(job_id, None)
      self._store.delete_job(job_id)
      dropped.append((job_id, job.staging_token if job else None))
    return dropped

  def _evict(self, dropped: list[tuple[str, Optional[str]]]) -> None:
    for job_id, token in dropped:
      if self._recovery is not None:
        self._recovery.forget(job_id)
      if token and self._on_evict is not None:
        try:
          self._on_evict(token)
        except Exception:  # pylint: disable=broad-except
          _LOGGER.warning('Could not remove the artifacts of %s', job_id,
                          exc_info=True)

  # -- reading ------------------------------------------------------------

  @property
  def closing(self) -> bool:
    """Whether the registry is stopping (it takes no new jobs)."""
    return self._closing

  def _get(self, job_id: str) -> Job:
    job = self._jobs.get(job_id)
    if job is None:
      raise UnknownJobError(job_id)
    return job

  def job(self, job_id: str) -> JobSnapshot:
    with self._cond:
      return self._get(job_id).snapshot()

  def jobs(self) -> list[JobSnapshot]:
    """Every known job, oldest first."""
    self.expire_preparations()
    with self._cond:
      return sorted((j.snapshot() for j in self._jobs.values()),
                    key=lambda s: s.created)

  def state(self, job_id: str) -> StateEvent:
    with self._cond:
      job = self._get(job_id)
      return job.states[-1] if job.states else StateEvent(
          job.created, JobState.UNSPECIFIED)

  def pipeline(self, job_id: str) -> beam_runner_api_pb2.Pipeline:
    with self._cond:
      return self._get(job_id).pipeline

  def plan(self, job_id: str):
    """The plan the job's execution runs, once it planned (None before, or
    for an executor that has none): the status page draws it."""
    with self._cond:
      return getattr(self._get(job_id).execution, 'plan', None)

  def metrics(self, job_id: str) -> tuple[list, list]:
    """(committed, attempted) MonitoringInfos: live while the job runs."""
    from apache_beam.portability.api import metrics_pb2  # pylint: disable=import-outside-toplevel
    with self._cond:
      job = self._get(job_id)
      execution, final = job.execution, job.final_metrics
    if execution is not None and final is None:
      committed = list(getattr(execution, 'committed_metrics', []) or [])
      attempted = list(getattr(execution, 'attempted_metrics', []) or [])
      return committed, attempted or committed
    infos = [metrics_pb2.MonitoringInfo.FromString(m) for m in final or []]
    return infos, list(infos)

  def progress(self, job_id: str) -> Optional[dict]:
    """The engine's progress (plain data, engine.OPTIONAL_METHODS): live
    while the job runs, the last one after; None if there is none."""
    return self._status(job_id, 'progress')

  def streaming_status(self, job_id: str) -> Optional[dict]:
    """A streaming engine's own status, if it offers one."""
    return self._status(job_id, 'streaming_status')

  def _status(self, job_id: str, name: str) -> Optional[dict]:
    with self._cond:
      job = self._get(job_id)
      execution, final = job.execution, job.final_status
    if final is not None:
      return final.get(name)
    return _call(execution, name)

  def messages(self, job_id: str) -> list[MessageEvent]:
    with self._cond:
      job = self._get(job_id)
      streams.load_history(job, self._store)
      return [e for e in job.events if isinstance(e, MessageEvent)]

  def subscribe(self, job_id: str, messages: bool = True,
                active: Callable[[], bool] = lambda: True,
                poll_secs: float = 1.0) -> Iterator[Event]:
    """The job's events from its start, then live ones as they come.

    Only state events unless ``messages``. Ends after a terminal state, or
    when ``active()`` turns false (the client went away). Raises
    UnknownJobError at once for an unknown id.
    """
    with self._cond:
      job = self._get(job_id)
      streams.load_history(job, self._store)
    return streams.follow(job, self._cond, messages, active, poll_secs)

  def wait(self, job_id: str, timeout: Optional[float] = None) -> int:
    """Waits until the job ends (or ``timeout`` seconds); its state."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      job = self._get(job_id)
      while not job.terminal:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          break
        self._cond.wait(remaining)
      return job.state
