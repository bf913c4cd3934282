"""What the job registry (jobs.py) keeps per job, and its errors."""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.events import TERMINAL_STATES
from beam_pyspark.events import Event
from beam_pyspark.events import JobState
from beam_pyspark.events import JobStateError  # pylint: disable=unused-import
from beam_pyspark.events import StateEvent

# Events a live job keeps in memory for its message stream; the store keeps
# the last DEFAULT_MAX_MESSAGES of its messages for after a restart.
MAX_LIVE_EVENTS = 10000


class UnknownJobError(KeyError):
  """No job or preparation has this id."""
  def __init__(self, job_id: str):
    super().__init__(job_id)
    self.job_id = job_id

  def __str__(self) -> str:
    return (f'No job or preparation with id {self.job_id!r}; GetJobs lists '
            'the known jobs.')


class ShuttingDownError(Exception):
  """The service is stopping: it takes no new jobs."""


class TooManyPreparationsError(Exception):
  """As many preparations as the service keeps wait to be run."""


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
  """What readers (the Job API, the status page) see of one job."""
  job_id: str
  job_name: str
  state: int
  created: float
  states: tuple[StateEvent, ...]
  options: dict
  staging_token: Optional[str]
  has_run: bool


class Job:
  """One job's record; guarded by the registry's condition."""
  def __init__(self, job_id: str, job_name: str, options: dict,
               created: float, staging_token: Optional[str],
               pipeline: Optional[beam_runner_api_pb2.Pipeline] = None,
               pipeline_bytes: Optional[bytes] = None):
    self.job_id = job_id
    self.job_name = job_name
    self.options = options
    self.created = created
    self.staging_token = staging_token
    self._pipeline = pipeline
    self._pipeline_bytes = pipeline_bytes
    self.states: list[StateEvent] = []
    # States and messages in order, for the message stream. Past jobs load
    # their messages from the store when first asked.
    self.events: collections.deque[Event] = collections.deque(
        maxlen=MAX_LIVE_EVENTS)
    self.dropped_events = 0
    self.execution = None
    # Which execution's events count: the registry moves it on when it
    # runs the job again after a restart, or lets a stopping one go.
    self.generation = 0
    self.has_run = False
    # Who prepared it (a peer's host): preparations are bounded per client.
    self.client = ''
    self.past = False
    self.messages_loaded = True
    self.final_metrics: Optional[list[bytes]] = None
    # The execution's last progress and streaming status, once it ended.
    self.final_status: Optional[dict] = None

  @property
  def pipeline(self) -> beam_runner_api_pb2.Pipeline:
    if self._pipeline is None:
      self._pipeline = beam_runner_api_pb2.Pipeline.FromString(
          self._pipeline_bytes or b'')
    return self._pipeline

  @property
  def state(self) -> int:
    return self.states[-1].state if self.states else JobState.UNSPECIFIED

  @property
  def terminal(self) -> bool:
    return self.state in TERMINAL_STATES

  def snapshot(self) -> JobSnapshot:
    return JobSnapshot(
        job_id=self.job_id, job_name=self.job_name, state=self.state,
        created=self.created, states=tuple(self.states),
        options=dict(self.options), staging_token=self.staging_token,
        has_run=self.has_run)
