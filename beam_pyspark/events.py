"""What a job reports while it runs: typed state and message events.

A leaf every layer may import. The engine's execution emits these; the job
registry (jobservice/jobs.py) is their one owner and keeps their history;
the Job API, the runner's result and the status page read them there.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from apache_beam.portability.api import beam_job_api_pb2

JobState = beam_job_api_pb2.JobState
Importance = beam_job_api_pb2.JobMessage.MessageImportance

class JobStateError(Exception):
  """A request the job's state does not allow (e.g. Run twice, or drain a
  batch job)."""


TERMINAL_STATES = frozenset([
    JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.DRAINED,
    JobState.UPDATED
])


@dataclasses.dataclass(frozen=True)
class StateEvent:
  timestamp: float  # seconds since the epoch
  state: int  # beam_job_api_pb2.JobState

  @property
  def terminal(self) -> bool:
    return self.state in TERMINAL_STATES


@dataclasses.dataclass(frozen=True)
class MessageEvent:
  timestamp: float
  importance: int  # beam_job_api_pb2.JobMessage.MessageImportance
  text: str


Event = Union[StateEvent, MessageEvent]


def state_name(state: int) -> str:
  return JobState.Enum.Name(state)
