"""GroupByKey in streaming: Beam's trigger driver per key, across batches.

A streaming GroupByKey cannot wait for the end of its input: it emits panes
as its windowing's trigger fires (early, on time, late), keeps what it has
not emitted as per-key state between micro-batches, and holds its output
watermark at the earliest element it still holds. Beam's own
``GeneralTriggerDriver`` decides all of that, as the DirectRunner's
``_StreamingGroupAlsoByWindowEvaluator`` drives it: ``process_elements``
for a key's new elements, ``process_timer`` for each of its due timers
(end of window, garbage collection, processing-time delays), over an
``InMemoryUnmergedState`` per key.

``KeyedGrouper`` is that, sans-I/O: fed a batch's elements per key and the
stage's watermarks and processing time, it returns the panes to emit;
``snapshot()`` turns its state into plain picklable data (Beam's
``InMemoryUnmergedState`` holds a lambda) for the runner's state store, and
``restore()`` brings it back in another process or after a restart.
"""

from __future__ import annotations

import collections
from typing import Any
from typing import Iterable
from typing import Optional

from apache_beam.transforms import trigger as beam_trigger
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import MAX_TIMESTAMP
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.timestamp import Timestamp


class _Clock:
  """The processing time the trigger driver sees: the batch's, durable
  (read from the batch's offset), so a replayed batch fires the same."""
  def __init__(self):
    self.now = MIN_TIMESTAMP

  def time(self) -> float:
    return float(self.now)


def _plain_state(state: beam_trigger.InMemoryUnmergedState) -> dict:
  return {
      'timers': {w: dict(t) for w, t in state.timers.items() if t},
      'state': {w: {tag: list(v) if isinstance(v, list) else v
                    for tag, v in tags.items()}
                for w, tags in state.state.items() if tags},
      'global': dict(state.global_state),
  }


def _state_from(plain: dict) -> beam_trigger.InMemoryUnmergedState:
  state = beam_trigger.InMemoryUnmergedState()
  for window, timers in plain['timers'].items():
    state.timers[window].update(timers)
  for window, tags in plain['state'].items():
    for tag, value in tags.items():
      state.state[window][tag] = list(value) if isinstance(
          value, list) else value
  state.global_state.update(plain['global'])
  return state


def _empty(state: beam_trigger.InMemoryUnmergedState) -> bool:
  return not any(state.timers.values()) and not any(
      state.state.values()) and not state.global_state


class KeyedGrouper:
  """One streaming GroupByKey's state: per key, Beam's trigger state."""
  def __init__(self, windowing):
    self._clock = _Clock()
    self._driver = beam_trigger.create_trigger_driver(
        windowing, is_batch=False, clock=self._clock)
    self._states: dict[Any, beam_trigger.InMemoryUnmergedState] = {}
    self._lateness = windowing.allowed_lateness
    # Beam's GeneralTriggerDriver keys state by window ids (with a window ->
    # ids map in global state) whenever it says it is merging, as it does
    # for non-merging window functions too.
    self._merging = getattr(self._driver, 'is_merging',
                            windowing.windowfn.is_merging())
    # Keys whose state changed (or went) since the grouper was made.
    self.touched: set = set()

  def __len__(self) -> int:
    return len(self._states)

  def keys(self):
    return self._states.keys()

  def process(self, key, values: Iterable, input_watermark: Timestamp,
              output_watermark: Timestamp,
              processing_time: Optional[Timestamp] = None) -> list:
    """A key's new elements (WindowedValues): the panes they fire now, as
    WindowedValues of (key, [values])."""
    if processing_time is not None:
      self._clock.now = processing_time
    self.touched.add(key)
    state = self._states.get(key)
    if state is None:
      state = self._states[key] = beam_trigger.InMemoryUnmergedState()
    panes = [
        wv.with_value((key, wv.value)) for wv in self._driver.process_elements(
            state, values, output_watermark, input_watermark)
    ]
    self._forget_if_empty(key, state)
    return panes

  def advance(self, input_watermark: Timestamp,
              processing_time: Optional[Timestamp] = None) -> list:
    """Fires every key's timers that are due at this watermark and
    processing time, in timestamp order per key, until none are due (a
    firing may set a timer that is due at once); the panes they emit."""
    if processing_time is not None:
      self._clock.now = processing_time
    panes = []
    for key in list(self._states):
      state = self._states[key]
      while True:
        due, _ = state.get_timers(
            clear=True, watermark=input_watermark,
            processing_time=self._clock.now)
        if not due:
          break
        self.touched.add(key)
        due.sort(key=lambda fired: fired[1][2])
        for window, (name, time_domain, timestamp, _tag) in due:
          for wv in self._driver.process_timer(
              window, name, time_domain, timestamp, state, input_watermark):
            panes.append(wv.with_value((key, wv.value)))
      self._forget_if_empty(key, state, input_watermark)
    return panes

  def hold(self) -> Timestamp:
    """The earliest output watermark hold over all keys (MAX: none)."""
    return min((s.get_earliest_hold() for s in self._states.values()),
               default=MAX_TIMESTAMP)

  def next_processing_time(self) -> Optional[Timestamp]:
    """When the earliest processing-time timer of any key is due."""
    return self._next_fire(TimeDomain.REAL_TIME)

  def next_event_time(self) -> Optional[Timestamp]:
    """The watermark at which the earliest event-time timer is due."""
    return self._next_fire(TimeDomain.WATERMARK)

  def _next_fire(self, time_domain) -> Optional[Timestamp]:
    times = [
        timestamp for state in self._states.values()
        for timers in state.timers.values()
        for (_, domain, _), timestamp in timers.items()
        if domain == time_domain
    ]
    return min(times, default=None)

  def _forget_if_empty(self, key, state,
                       input_watermark: Timestamp = MIN_TIMESTAMP) -> None:
    """Drops a key's state once nothing of it can matter again: empty, or
    no timer left and every window of it past its allowed lateness (the
    driver drops any element for such a window before reading its state;
    what is left is the tombstone of its last pane)."""
    if _empty(state) or (not any(state.timers.values()) and all(
        window.end + self._lateness < input_watermark
        for window in self._windows(state))):
      if self._states.pop(key, None) is not None:
        self.touched.add(key)

  def _windows(self, state) -> list:
    if self._merging:
      # MergeableStateAdapter keeps window -> state ids in global state.
      return list((state.global_state.get('window_ids') or {}).keys())
    return list(state.state.keys())

  # -- the state store's view ---------------------------------------------

  def snapshot(self, keys: Optional[Iterable] = None) -> dict:
    """Plain, picklable state of ``keys`` (default all)."""
    keys = self._states.keys() if keys is None else keys
    return {k: _plain_state(self._states[k]) for k in keys
            if k in self._states}

  def restore(self, snapshot: dict) -> None:
    for key, plain in snapshot.items():
      self._states[key] = _state_from(plain)

  def adopt(self, states: dict) -> None:
    """Takes ``states`` (a ``states()`` of another grouper, not used by it
    any more) as its own."""
    self._states = states

  def states(self) -> dict:
    """The live state objects by key (for ``adopt``)."""
    return self._states

  def drop(self, keys: Iterable) -> None:
    for key in keys:
      self._states.pop(key, None)


def group_by_key_in_batches(windowing, batches,
                            start_time: Timestamp = Timestamp(0)) -> list:
  """Runs a grouper over ``batches`` of (elements as (key, WindowedValue),
  watermark, processing time): each batch's elements arrive at the
  processing time the previous batch ended at (``start_time`` for the
  first), then the input watermark and processing time move to the
  batch's, and what is due fires. Every pane, in order. (TestStream's
  semantics: elements, watermark and processing-time advances applied in
  order.)"""
  grouper = KeyedGrouper(windowing)
  panes = []
  input_watermark = output_watermark = MIN_TIMESTAMP
  now = start_time
  for elements, watermark, processing_time in batches:
    by_key = collections.defaultdict(list)
    for key, wv in elements:
      by_key[key].append(wv)
    for key, values in by_key.items():
      panes.extend(grouper.process(key, values, input_watermark,
                                   output_watermark, now))
    input_watermark = max(input_watermark, watermark)
    now = max(now, processing_time)
    panes.extend(grouper.advance(input_watermark, now))
    output_watermark = max(output_watermark,
                           min(input_watermark, grouper.hold()))
  return panes
