"""One key's panes of a bounded GroupByKey, with Beam's end of input.

Beam's Python trigger driver (``GeneralTriggerDriver.process_entire_key``)
fires what its triggers and end-of-window timers say, but knows nothing of
garbage collection: no pane is ever the last (``is_last``) unless its
trigger finished, and ``ClosingBehavior.EMIT_ALWAYS`` never emits. Beam's
model (Java's ``ReduceFnRunner``, which Java's and Go's own runners and
their ValidatesRunner tests follow) closes each window when the watermark
passes its end plus the allowed lateness: at the end of a bounded input,
for every window at once. Then

* a pane fired at that moment is the window's last (``is_last``): the
  end-of-window pane when the allowed lateness is 0;
* if none was, the window emits a final pane when it holds elements no
  pane carried yet, or always under ``EMIT_ALWAYS`` (its contents: every
  element when accumulating, the new ones when discarding), ``is_last``,
  on time if it closes at its end and no on-time pane came before, else
  late.

Merging windows keep Python's driver as it is (a merged window's panes
are its driver's). Which groupings use this: planning (GroupSpec's
``final_panes``, the pipelines of SDKs other than Python; Python's own
runners give Python's driver's panes, and so does this runner).
"""

from __future__ import annotations

from typing import Iterator

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.transforms import trigger
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import PaneInfo
from apache_beam.utils.windowed_value import PaneInfoTiming
from apache_beam.utils.windowed_value import WindowedValue

_EMIT_ALWAYS = beam_runner_api_pb2.ClosingBehavior.EMIT_ALWAYS
_LATE = (PaneInfoTiming.ON_TIME, PaneInfoTiming.LATE)


def _replace_pane(wv: WindowedValue, pane: PaneInfo) -> WindowedValue:
  return WindowedValue(wv.value, wv.timestamp, wv.windows, pane)


def key_panes(driver, windowing, proto: beam_runner_api_pb2.WindowingStrategy,
              key, values: list) -> Iterator[WindowedValue]:
  """(key, values) panes of one key's ``values`` (WindowedValues), as
  ``driver.process_entire_key`` gives them, closed as Beam's model closes
  windows at the end of a bounded input."""
  if windowing.windowfn.is_merging() or isinstance(
      driver, trigger.BatchGlobalTriggerDriver):
    yield from driver.process_entire_key(key, values)
    return
  state = trigger.InMemoryUnmergedState()
  outputs = list(driver.process_elements(state, values, MIN_TIMESTAMP,
                                         MIN_TIMESTAMP))
  at_end = len(outputs)  # those after: fired as the watermark passed all
  while state.timers:
    for window, (name, domain, fire_time, _) in state.get_and_clear_timers():
      outputs.extend(driver.process_timer(window, name, domain, fire_time,
                                          state))
  last: dict = {}
  panes: dict = {}
  for i, wv in enumerate(outputs):
    window, = wv.windows
    last[window] = i
    panes.setdefault(window, []).append(wv.pane_info)
  by_window: dict = {}
  for wv in values:
    for window in wv.windows:
      by_window.setdefault(window, []).append(wv)
  closes_at_end = proto.allowed_lateness == 0
  accumulating = (proto.accumulation_mode ==
                  beam_runner_api_pb2.AccumulationMode.ACCUMULATING)
  extra = []
  for window, elements in by_window.items():
    i = last.get(window)
    if i is not None and outputs[i].pane_info.is_last:
      continue  # its trigger finished: closed already
    if i is not None and i >= at_end and closes_at_end:
      p = outputs[i].pane_info
      outputs[i] = _replace_pane(outputs[i], PaneInfo(
          p.is_first, True, p.timing, p.index, p.nonspeculative_index))
      continue
    fired = panes.get(window, [])
    if fired and proto.closing_behavior != _EMIT_ALWAYS:
      continue  # nothing new since its last pane: no final pane
    contents = ([e.value for e in elements] if accumulating or not fired
                else [])
    nonspeculative = sum(1 for p in fired if p.timing in _LATE)
    timing = (PaneInfoTiming.ON_TIME if closes_at_end and not nonspeculative
              else PaneInfoTiming.LATE)
    times = [e.timestamp for e in elements]
    timestamp = window.max_timestamp()
    if contents and not fired:
      timestamp = _output_time(windowing, window, times) or timestamp
    extra.append(WindowedValue(contents, timestamp, (window,), PaneInfo(
        not fired, True, timing, len(fired), nonspeculative)))
  for wv in outputs + extra:
    yield wv.with_value((key, wv.value))


def _output_time(windowing, window, timestamps):
  """The timestamp combiner's output time of elements at ``timestamps``."""
  from apache_beam.transforms.window import TimestampCombiner
  combiner = TimestampCombiner.get_impl(windowing.timestamp_combiner,
                                        windowing.windowfn)
  return combiner.merge(
      window, (combiner.assign_output_time(window, t) for t in timestamps))
