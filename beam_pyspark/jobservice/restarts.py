"""The job registry across restarts of the job server: what a start
makes of the jobs an earlier run left unfinished, and what SIGTERM does to
running ones.

A part of ``JobRegistry`` (jobs.py), split off by size: ``Restarts`` is
one of its bases and shares its state and its condition. At start-up,
every job the store holds comes back; one that had not ended ends FAILED
saying why, unless it is a streaming job ``recovery`` (recovery.py) says
can resume from its checkpoint: ``resume()`` runs it again. At SIGTERM
(``shutdown()``) the server takes no new jobs, stops streaming jobs at
once (they end STOPPED, checkpoints kept, for the next start to resume),
lets other running jobs finish within a grace period and cancels the rest.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable
from typing import Optional
from typing import Union

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.events import Importance
from beam_pyspark.events import JobState
from beam_pyspark.events import MessageEvent
from beam_pyspark.events import StateEvent
from beam_pyspark.jobservice import streams
from beam_pyspark.jobservice.records import Job
from beam_pyspark.jobservice.recovery import Resume
from beam_pyspark.jobservice.recovery import StreamingRecovery
from beam_pyspark.jobservice.store import JobStore

_LOGGER = logging.getLogger(__name__)


class Restarts:
  """JobRegistry's start-up and shutdown (its other methods, used here,
  are in jobs.py)."""
  _cond: threading.Condition
  _jobs: dict[str, Job]
  _finished: collections.deque
  _store: JobStore
  _clock: Callable[[], float]
  _closing: bool
  _recovery: Optional[StreamingRecovery]
  # Jobs of an earlier run waiting to be run again (resume()).
  _resumable: dict[str, Resume]

  # -- start-up -----------------------------------------------------------

  def _recover(self) -> None:
    """Jobs of earlier runs of the server, from the store; those that were
    still running did not finish, unless they can resume (resumable())."""
    for record in self._store.jobs():
      job = Job(record.job_id, record.job_name, record.options,
                 record.created, record.staging_token,
                 pipeline_bytes=record.pipeline)
      job.past = True
      job.has_run = any(s != JobState.STOPPED for _, s in record.states)
      job.messages_loaded = False
      job.final_metrics = record.metrics
      job.states = [StateEvent(ts, s) for ts, s in record.states]
      self._jobs[job.job_id] = job
      if not job.terminal:
        decision = self._after_restart(job)
        if isinstance(decision, Resume):
          self._resumable[job.job_id] = decision  # not ended: not history
          continue
        self._append_message(job, MessageEvent(
            self._clock(), Importance.JOB_MESSAGE_ERROR,
            decision or 'The job server stopped while this job was '
            f'{"running" if job.has_run else "prepared"}; it did not finish.'))
        self._append_state(job, StateEvent(self._clock(), JobState.FAILED))
      self._finished.append(job.job_id)
    # A restarted server holds no more than its bound, at once.
    self._evict(self._trim())

  def _after_restart(self, job: Job) -> Union[Resume, str, None]:
    """What recovery says of an unfinished job that had run (a Resume, or
    why not), None if it has nothing to say. A job being cancelled is not
    run again."""
    if (self._recovery is None or not job.has_run or
        job.state == JobState.CANCELLING):
      return None
    try:
      return self._recovery.after_restart(job.job_id, job.pipeline,
                                          job.options)
    except Exception:  # pylint: disable=broad-except
      # Options or a pipeline no engine could run: it ends FAILED, as
      # any job left unfinished.
      _LOGGER.warning('Cannot tell whether %s can resume', job.job_id,
                      exc_info=True)
      return None

  def resumable(self) -> list[str]:
    """Jobs an earlier run of the server left unfinished that resume()
    runs again, oldest first."""
    with self._cond:
      return sorted(self._resumable, key=lambda i: self._jobs[i].created)

  def resume(self, job_id: str,
             resolve: Optional[Callable[[str], beam_runner_api_pb2.Pipeline]]
             = None) -> None:
    """Runs a resumable() job again from its checkpoint, with the pipeline
    ``resolve(job_id)`` gives (its artifacts resolved), else its stored
    one. If that raises, or the executor does, the job ends FAILED with
    the reason; nothing is raised here."""
    with self._cond:
      decision = self._resumable.pop(job_id, None)
      job = self._get(job_id)
      if decision is None or job.terminal:  # cancelled meanwhile
        return
      streams.load_history(job, self._store)
      job.generation += 1
    self.note(job_id, decision.message(), Importance.JOB_MESSAGE_BASIC)
    try:
      pipeline = resolve(job_id) if resolve is not None else job.pipeline
      execution = self._invoke(job_id, pipeline, job.options,
                               self._listener(job_id))
      with self._cond:
        job.execution = execution
        cancelled = job.terminal  # a Cancel while it was being built
      if not cancelled:
        execution.start()
    except Exception as exn:  # pylint: disable=broad-except
      with self._cond:
        job.execution = None
      self._end(job, JobState.FAILED,
                f'Could not resume the job after the job server restarted: '
                f'{type(exn).__name__}: {exn}')

  # -- shutdown -------------------------------------------------------------

  def shutdown(self, grace_secs: float, reason: str,
               cancel_wait_secs: float = 10.0) -> None:
    """Stops taking jobs. Streaming jobs that can resume are stopped at
    once, their checkpoints kept, and end STOPPED (Beam's "paused or not
    yet started"): the next start resumes them. Other running jobs may
    finish within ``grace_secs``, then are cancelled, saying why. Jobs
    that do not stop within ``cancel_wait_secs`` of their cancel (or
    stop), and preparations never run, end FAILED / CANCELLED (STOPPED)
    here, so the store never keeps a job RUNNING that no process runs."""
    with self._cond:
      self._closing = True
      # Jobs waiting to resume stay as they are: the next start tries again.
      running = [j for j in self._jobs.values() if j.has_run and
                 not j.terminal and j.job_id not in self._resumable]
      preparations = self._preparations()
    for job in preparations:
      self._end(job, JobState.CANCELLED,
                f'{reason}: this preparation was never run.')
    paused = [j for j in running if self._interrupt(j, reason)]
    running = [j for j in running if j not in paused]
    late = self._still_running(running, grace_secs)
    for job in late:
      self.note(job.job_id,
                f'{reason}: cancelling this job, which did not finish within '
                f'the {grace_secs:.0f} s grace period.',
                Importance.JOB_MESSAGE_ERROR)
      try:
        self.cancel(job.job_id)
      except Exception:  # pylint: disable=broad-except
        _LOGGER.warning('Could not cancel %s', job.job_id, exc_info=True)
    stuck = self._still_running(late, cancel_wait_secs)
    for job in stuck:
      self._end(job, JobState.FAILED,
                f'{reason}: the job did not stop within '
                f'{cancel_wait_secs:.0f} s of its cancel.')
    for job in self._still_running(paused, cancel_wait_secs):
      self._detach(job, f'{reason}: the job did not stop within '
                   f'{cancel_wait_secs:.0f} s; its checkpoint is kept, and '
                   'the next start of the job server resumes it from its last '
                   'committed micro-batch.')

  def _interrupt(self, job: Job, reason: str) -> bool:
    """Asks a job's execution to stop so that it can resume (a streaming
    job, between micro-batches, its checkpoint kept); False if it cannot."""
    interrupt = getattr(job.execution, 'interrupt', None)
    try:
      return bool(interrupt is not None and interrupt(reason))
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('Could not stop %s', job.job_id, exc_info=True)
      return False

  def _detach(self, job: Job, why: str) -> None:
    """Records a stopping job STOPPED, for the next start to resume; its
    execution, which the process's end stops, is not heard from again."""
    with self._cond:
      if job.terminal or job.state == JobState.STOPPED:
        return
      job.generation += 1
      self._append_message(job, MessageEvent(
          self._clock(), Importance.JOB_MESSAGE_WARNING, why))
      self._append_state(job, StateEvent(self._clock(), JobState.STOPPED))
      self._cond.notify_all()

  def _still_running(self, jobs: list[Job], secs: float) -> list[Job]:
    """Waits up to ``secs`` for ``jobs`` to end (or stop, for the next
    start to resume them); those that did not."""
    def going(job: Job) -> bool:
      return not job.terminal and job.state != JobState.STOPPED

    deadline = time.monotonic() + secs
    with self._cond:
      while (any(going(j) for j in jobs) and time.monotonic() < deadline):
        self._cond.wait(max(0.0, min(1.0, deadline - time.monotonic())))
      return [j for j in jobs if going(j)]
