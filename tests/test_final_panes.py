"""Beam's end of input for a bounded GroupByKey (worker.shuffle.panes).

Expected panes are those of Beam's model as Java's ReduceFnRunner gives
them (and Java's ValidatesRunner tests check, e.g. PAssertTest
#testWindowedIsEqualTo, CombineTest#testGlobalCombineWithDefaultsAndTriggers):
every window closes when the bounded input ends.
"""

from __future__ import annotations

from apache_beam.portability.api import beam_runner_api_pb2 as rapi
from apache_beam.runners import pipeline_context
from apache_beam.transforms import trigger
from apache_beam.transforms import window
from apache_beam.transforms.core import Windowing
from apache_beam.utils.timestamp import Duration
from apache_beam.utils.windowed_value import PaneInfoTiming as T
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.worker.shuffle.panes import key_panes

ACC = trigger.AccumulationMode.ACCUMULATING
DIS = trigger.AccumulationMode.DISCARDING


def _panes(windowing, values, closing=rapi.ClosingBehavior.EMIT_IF_NONEMPTY):
  proto = windowing.to_runner_api(pipeline_context.PipelineContext())
  proto.closing_behavior = closing
  driver = trigger.create_trigger_driver(windowing, is_batch=True)
  out = list(key_panes(driver, windowing, proto, 'k', values))
  return [(w.windows[0], sorted(w.value[1]), w.pane_info.is_first,
           w.pane_info.is_last, w.pane_info.timing, w.pane_info.index)
          for w in out]


def _values(fn, items):
  return [WindowedValue(v, t, fn.assign(window.WindowFn.AssignContext(t)))
          for v, t in items]


def test_fixed_windows_default_trigger_one_final_on_time_pane_each():
  fn = window.FixedWindows(10)
  panes = _panes(Windowing(fn), _values(fn, [(1, 1), (2, 2), (3, 12)]))
  assert sorted(panes, key=lambda p: p[0].start) == [
      (window.IntervalWindow(0, 10), [1, 2], True, True, T.ON_TIME, 0),
      (window.IntervalWindow(10, 20), [3], True, True, T.ON_TIME, 0)]


def test_allowed_lateness_keeps_the_on_time_pane_open_emit_always_closes():
  fn = window.FixedWindows(10)
  w = Windowing(fn, allowed_lateness=Duration(seconds=5))
  values = _values(fn, [(1, 1)])
  assert _panes(w, values) == [
      (window.IntervalWindow(0, 10), [1], True, False, T.ON_TIME, 0)]
  assert _panes(w, values, rapi.ClosingBehavior.EMIT_ALWAYS) == [
      (window.IntervalWindow(0, 10), [1], True, False, T.ON_TIME, 0),
      (window.IntervalWindow(0, 10), [], False, True, T.LATE, 1)]


def test_repeated_count_trigger_accumulating_emit_always_ends_with_the_sum():
  fn = window.GlobalWindows()
  w = Windowing(fn, trigger.Repeatedly(trigger.AfterCount(1)), ACC)
  values = _values(fn, [(1, 0), (1, 0)])
  g = window.GlobalWindow()
  assert _panes(w, values, rapi.ClosingBehavior.EMIT_ALWAYS) == [
      (g, [1, 1], True, False, T.EARLY, 0),
      (g, [1, 1], False, True, T.ON_TIME, 1)]
  # Nothing new since that pane: no final pane unless EMIT_ALWAYS.
  assert _panes(w, values) == [(g, [1, 1], True, False, T.EARLY, 0)]


def test_a_trigger_that_never_fired_emits_its_elements_when_the_window_closes():
  fn = window.GlobalWindows()
  w = Windowing(fn, trigger.AfterCount(10), DIS)
  assert _panes(w, _values(fn, [(1, 0), (2, 0), (3, 0)])) == [
      (window.GlobalWindow(), [1, 2, 3], True, True, T.ON_TIME, 0)]
