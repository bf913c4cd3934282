"""Pending timers of one task: a small state machine with no I/O.

Batch semantics: once a task's input is exhausted its watermark is
effectively at infinity, so every pending timer may fire.  Timers fire in
rounds, in timestamp order; a round's firings may set new timers for the
next round.  Per (transform, family, key, dynamic tag, window) the last
write wins and a clear deletes, as in Beam's FnApiRunner.
"""

from __future__ import annotations

from typing import Any


class TimerTable:
  def __init__(self):
    self._pending: dict[tuple[str, str], dict[Any, Any]] = {}

  def written(self, transform_id: str, family_id: str, timers) -> None:
    table = self._pending.setdefault((transform_id, family_id), {})
    for timer in timers:
      key = (timer.user_key, timer.dynamic_timer_tag, timer.windows[0])
      if timer.clear_bit:
        table.pop(key, None)
      else:
        table[key] = timer

  def __bool__(self) -> bool:
    return any(self._pending.values())

  def take_round(self) -> dict[tuple[str, str], list]:
    """All pending timers, each family's sorted by fire time; clears them."""
    fired = {}
    for family, table in self._pending.items():
      if table:
        fired[family] = sorted(table.values(), key=lambda t: t.fire_timestamp)
    self._pending = {}
    return fired
