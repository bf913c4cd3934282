"""A streaming job over time: one point per micro-batch, for charts.

Each point holds what the status page charts (and /api returns): records
read and emitted per second, the micro-batch's duration, each read's and
each stage's watermark lag (wall clock minus its output watermark), and
the backlog, in total and per endpoint. Two views: the last ``recent``
micro-batches, and the job since its start in at most ``since_start``
points (every other point dropped when full, so older history thins out
evenly). Sans-I/O: the engine hands in plain numbers.
"""

from __future__ import annotations

import collections
from typing import Optional

from apache_beam.utils.timestamp import MAX_TIMESTAMP
from apache_beam.utils.timestamp import MIN_TIMESTAMP

_MIN = MIN_TIMESTAMP.micros
_MAX = MAX_TIMESTAMP.micros


def lag_secs(now_secs: float, watermark_micros: Optional[int]) -> Optional[float]:
  """Wall clock minus a watermark, in seconds; None while the watermark is
  at -inf (nothing known yet) or +inf (done: no lag to speak of)."""
  if watermark_micros is None or watermark_micros <= _MIN or (
      watermark_micros >= _MAX):
    return None
  return round(now_secs - watermark_micros / 1e6, 3)


class StreamSeries:
  """The points of a streaming job, one per committed micro-batch."""
  def __init__(self, recent: int = 120, since_start: int = 240):
    self.recent: collections.deque = collections.deque(maxlen=recent)
    self._since_start: list[dict] = []
    self._cap = since_start
    self._stride = 1
    self._added = 0
    self._last: Optional[tuple[float, int, int]] = None

  def add(self, *, batch: int, time: float, secs: float, read: int,
          emitted: int, read_watermarks: dict[str, Optional[int]],
          stage_watermarks: dict[str, Optional[int]], backlog: float,
          endpoint_backlogs: dict[str, Optional[float]],
          interval: Optional[float] = None) -> dict:
    """The point of micro-batch ``batch`` that ended at wall ``time``
    (seconds): ``read``/``emitted`` are totals since the job started (the
    rates are their change since the previous point over the time between,
    the first point's over its own duration); watermarks in micros."""
    if self._last is None:
      span, read_before, emitted_before = max(secs, 1e-3), 0, 0
    else:
      before, read_before, emitted_before = self._last
      span = max(time - before, 1e-3)
    self._last = (time, read, emitted)
    point = {
        'batch': batch,
        'time': round(time, 3),
        'secs': round(secs, 3),
        'interval': interval,
        'read': read,
        'emitted': emitted,
        'read_per_sec': round(max(0, read - read_before) / span, 3),
        'emitted_per_sec': round(max(0, emitted - emitted_before) / span, 3),
        'read_lag': {k: lag_secs(time, w) for k, w in
                     sorted(read_watermarks.items())},
        'stage_lag': {k: lag_secs(time, w) for k, w in
                      sorted(stage_watermarks.items())},
        'backlog': backlog,
        'endpoint_backlog': dict(sorted(endpoint_backlogs.items())),
    }
    self.recent.append(point)
    if self._added % self._stride == 0:
      self._since_start.append(point)
      if len(self._since_start) > self._cap:
        self._since_start = self._since_start[::2]
        self._stride *= 2
    self._added += 1
    return point

  def snapshot(self) -> dict:
    """{'recent': [...], 'since_start': [...]}: copies, as plain data."""
    since = list(self._since_start)
    if self.recent and (not since or since[-1] is not self.recent[-1]):
      since.append(self.recent[-1])  # the newest point is always shown
    return {'recent': list(self.recent), 'since_start': since}
