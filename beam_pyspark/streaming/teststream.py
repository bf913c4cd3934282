"""A TestStream as a sequence of micro-batches, sans-I/O.

Beam's TestStream applies its events in order: elements are added at the
current processing time, then the watermark of a tag, or processing time,
advances. A micro-batch here is what arrives before one such advance,
then the advance: batch *i* holds the element events since the previous
advance and the watermarks and processing time after advance *i*. Elements
at the end with no advance after them form a last batch. After the last
batch every watermark goes to +inf (the stream is exhausted), as Beam's
runners do when a TestStream ends.

A batch keeps its element events apart (``events``): the engine runs each
to quiescence (every wave its elements cause, timers included) before the
next, as Beam's DirectRunner and Prism apply one event at a time; a
trigger sees one event's elements of a key together, as the DirectRunner's
bundle of that event.

The TestStream's endpoint (a TestStreamService replaying events from
elsewhere) is not supported: such a payload is refused.
"""

from __future__ import annotations

import dataclasses

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming import MIN_MICROS

# Beam's TestStream starts its processing-time clock at 0.
START_PROCESSING_TIME = 0


def _micros(value: int, unit: int = 1000) -> int:
  """A payload's time in microseconds (``unit``: micros per unit of the
  payload); Beam's +-inf survive as such."""
  if value >= MAX_MICROS // 1000:
    return MAX_MICROS
  if value <= MIN_MICROS // 1000:
    return MIN_MICROS
  return value * unit


@dataclasses.dataclass(frozen=True)
class TestStreamBatch:
  """One micro-batch of a TestStream."""
  __test__ = False  # not a pytest test class
  # The batch's element events, in order: each output tag -> [(timestamp
  # micros, encoded element)] it adds (times in the payload are
  # milliseconds; here microseconds, as Beam's Timestamp)
  events: tuple[dict[str, list[tuple[int, bytes]]], ...]
  # output tag -> watermark (micros) once this batch's advance is applied
  watermarks: dict[str, int]
  # processing time (micros) the elements arrived at, and after the advance
  arrival_time: int
  processing_time: int
  last: bool = False

  @property
  def elements(self) -> dict[str, list[tuple[int, bytes]]]:
    """Every element the batch adds, per output tag, in order."""
    merged: dict[str, list[tuple[int, bytes]]] = {}
    for event in self.events:
      for tag, added in event.items():
        merged.setdefault(tag, []).extend(added)
    return merged


def teststream_batches(payload: beam_runner_api_pb2.TestStreamPayload,
                       tags: list[str],
                       unit: int = 1000) -> list[TestStreamBatch]:
  """The micro-batches of a TestStream with these output tags.

  ``unit``: microseconds per unit of the events' times: milliseconds in a
  TestStream's payload; events read from a TestStreamService are taken as
  microseconds (1), as Beam's DirectRunner reads them.
  """
  if payload.endpoint.url:
    raise ValueError(
        f'a TestStream replayed from a TestStreamService '
        f'({payload.endpoint.url}) is not supported; give its events inline')
  watermarks = {tag: MIN_MICROS for tag in tags}
  # An event without a tag is for the main output ('None' in Python's
  # TestStream), or the only one.
  default = tags[0] if len(tags) == 1 else (
      'None' if 'None' in tags else '')
  now = START_PROCESSING_TIME
  batches: list[TestStreamBatch] = []
  events: list[dict[str, list[tuple[int, bytes]]]] = []
  arrival = now

  def close(last=False):
    nonlocal events, arrival
    batches.append(TestStreamBatch(
        events=tuple(events), watermarks=dict(watermarks),
        arrival_time=arrival, processing_time=now, last=last))
    events = []
    arrival = now

  for event in payload.events:
    kind = event.WhichOneof('event')
    if kind == 'element_event':
      added = event.element_event
      if added.elements:
        events.append({added.tag or default: [
            (_micros(e.timestamp, unit), e.encoded_element)
            for e in added.elements]})
      continue
    if kind == 'watermark_event':
      tag = event.watermark_event.tag or default
      # A watermark never moves back (Beam's TestStream refuses that too).
      watermarks[tag] = max(watermarks.get(tag, MIN_MICROS),
                            _micros(event.watermark_event.new_watermark, unit))
    elif kind == 'processing_time_event':
      now += event.processing_time_event.advance_duration * unit
    close()
  for tag in list(watermarks):
    watermarks[tag] = MAX_MICROS
  close(last=True)
  return batches
