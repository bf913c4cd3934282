"""A job's event stream, as the registry (jobs.py) serves it: its history
in time order, then live events as they come.

Functions over one ``Job`` and the registry's condition, which guards it;
the registry stays the only writer. Split from jobs.py by responsibility:
writing a job's life there, reading it here.
"""

from __future__ import annotations

import threading
from typing import Callable
from typing import Iterator

from beam_pyspark.events import Event
from beam_pyspark.events import MessageEvent
from beam_pyspark.events import StateEvent
from beam_pyspark.jobservice.records import Job
from beam_pyspark.jobservice.store import JobStore


def load_history(job: Job, store: JobStore) -> None:
  """A past job's stream: its states and stored messages, in time order
  (caller holds the registry's condition)."""
  if job.messages_loaded:
    return
  # Every message went through the store, those recorded since the
  # restart too.
  stored = [MessageEvent(ts, importance, text)
            for ts, importance, text in store.messages(job.job_id)]
  # In time order, the terminal state last: the stream ends with it, and
  # a message recorded at the same moment (why it ended) must come first.
  merged = sorted(
      list(job.states) + stored,
      key=lambda e: (isinstance(e, StateEvent) and e.terminal, e.timestamp))
  job.events.clear()
  job.events.extend(merged)
  job.messages_loaded = True


def follow(job: Job, cond: threading.Condition, messages: bool,
           active: Callable[[], bool], poll_secs: float) -> Iterator[Event]:
  """The job's events from its start, then live ones; ends after a
  terminal state, or once ``active()`` turns false (the client went
  away). Only state events unless ``messages``."""
  sent = 0  # events of job.events already seen, counting dropped ones
  while True:
    with cond:
      while (job.dropped_events + len(job.events) <= sent and active()):
        cond.wait(poll_secs)
      start = max(0, sent - job.dropped_events)
      pending = list(job.events)[start:]
      sent = job.dropped_events + len(job.events)
    if not pending:
      return  # the client went away
    for event in pending:
      if isinstance(event, MessageEvent) and not messages:
        continue
      yield event
      if isinstance(event, StateEvent) and event.terminal:
        return
