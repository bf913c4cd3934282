"""Pending timers, due by watermark and by processing time; no I/O.

One table per stage (and per key range, in streaming). A timer is
identified by (transform, family, key, dynamic tag, window): the last
write wins and a clear deletes it, as in Beam's FnApiRunner. A timer is
due when its fire time is at or behind its domain's clock: the stage's
input watermark for event-time timers, the batch's processing time for
processing-time ones. Due timers are taken in rounds, each family's sorted
by fire time; a round's firings may set timers for the next round.

While a timer waits, its output (hold) timestamp holds the stage's output
watermark (``hold()``), so that what it will output is not late.

Batch drives the table with both clocks at +inf once its input is
exhausted (``take_round``): every pending timer fires, round after round.
"""

from __future__ import annotations

from typing import Any
from typing import Optional

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.utils.timestamp import MAX_TIMESTAMP
from apache_beam.utils.timestamp import Timestamp

EVENT_TIME = beam_runner_api_pb2.TimeDomain.EVENT_TIME
PROCESSING_TIME = beam_runner_api_pb2.TimeDomain.PROCESSING_TIME

Family = tuple[str, str]  # (transform id, timer family id)


class TimerTable:
  def __init__(self, domains: Optional[dict[Family, int]] = None):
    # Families not listed are event-time ones.
    self._domains = dict(domains or {})
    self._pending: dict[Family, dict[Any, Any]] = {}

  def written(self, transform_id: str, family_id: str, timers) -> None:
    """Timers (Beam's ``userstate.Timer``) a bundle set or cleared."""
    table = self._pending.setdefault((transform_id, family_id), {})
    for timer in timers:
      key = (timer.user_key, timer.dynamic_timer_tag, timer.windows[0])
      if timer.clear_bit:
        table.pop(key, None)
      else:
        table[key] = timer

  def __bool__(self) -> bool:
    return any(self._pending.values())

  def __len__(self) -> int:
    return sum(len(t) for t in self._pending.values())

  def pending(self):
    """(family, timer) for every pending timer (to store them)."""
    for family, table in self._pending.items():
      for timer in table.values():
        yield family, timer

  def domain(self, family: Family) -> int:
    return self._domains.get(family, EVENT_TIME)

  def take_due(self, watermark: Timestamp,
               processing_time: Timestamp) -> dict[Family, list]:
    """The due timers, each family's sorted by fire time; removes them."""
    fired = {}
    for family, table in self._pending.items():
      clock = (processing_time if self.domain(family) == PROCESSING_TIME
               else watermark)
      due = [key for key, timer in table.items()
             if timer.fire_timestamp <= clock]
      if due:
        fired[family] = sorted((table.pop(k) for k in due),
                               key=lambda t: t.fire_timestamp)
    return fired

  def take_round(self) -> dict[Family, list]:
    """Batch at end of input: every pending timer is due."""
    return self.take_due(MAX_TIMESTAMP, MAX_TIMESTAMP)

  def hold(self) -> Optional[Timestamp]:
    """The earliest output timestamp of a pending timer, if any."""
    holds = [
        timer.hold_timestamp if timer.hold_timestamp is not None else
        timer.fire_timestamp
        for table in self._pending.values() for timer in table.values()
    ]
    return min(holds, default=None)

  def next_fire(self, domain: int) -> Optional[Timestamp]:
    """When the next timer of ``domain`` is due (for a processing-time
    trigger to know when to run the next batch)."""
    times = [
        timer.fire_timestamp for family, table in self._pending.items()
        if self.domain(family) == domain for timer in table.values()
    ]
    return min(times, default=None)
