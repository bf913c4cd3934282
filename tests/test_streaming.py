"""The streaming engine on local Spark, judged against Beam's DirectRunner.

Each pipeline is a TestStream (elements, watermark and processing-time
advances in order) into windowing, triggers, state, timers or side inputs.
It runs first on Beam's DirectRunner in this process, whose output is
collected as the reference, then on PySparkRunner with an assert_that of
that output: panes (timing, index), timestamps and windows included.
"""
import ast
import os
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.runner import PipelineState
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.test_stream import WindowedValueHolder
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import trigger
from apache_beam.transforms import userstate
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark import PySparkRunner

def _describe(element, ts=beam.DoFn.TimestampParam,
              w=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
  """What the comparison sees of an element: value, timestamp, window,
  pane timing and index. Timestamps in milliseconds: Beam's portable
  coders carry no finer (a window's max timestamp, end - 1 us, arrives as
  end - 1 ms through any portable runner); the DirectRunner never encodes."""
  value = element
  if isinstance(element, tuple) and len(element) == 2 and isinstance(
      element[1], list):
    value = (element[0], sorted(element[1]))
  where = ((w.start.micros, w.end.micros)
           if isinstance(w, window.IntervalWindow) else 'global')
  return (value, ts.micros // 1000, where, pane.timing, pane.index)


def _streaming_options():
  return PipelineOptions(['--streaming', '--allow_unsafe_triggers'])


class _Record(beam.DoFn):
  """Appends each element's repr to a file (the DirectRunner pickles
  DoFns, so a list in this process would not see them)."""
  def __init__(self, path):
    self.path = path

  def process(self, element):
    with open(self.path, 'a', encoding='utf-8') as f:
      f.write(repr(element) + '\n')


def check_against_direct_runner(build, tmp_path):
  """``build(p)`` returns a PCollection; it must come out of our runner as
  it comes out of Beam's DirectRunner."""
  path = tmp_path / 'reference.txt'
  with beam.Pipeline('DirectRunner', options=_streaming_options()) as p:
    _ = build(p) | beam.Map(_describe) | beam.ParDo(_Record(str(path)))
  expected = [ast.literal_eval(line)
              for line in path.read_text(encoding='utf-8').splitlines()]
  assert expected, 'the reference run produced nothing: a useless test'
  with beam.Pipeline(PySparkRunner(), options=_streaming_options()) as p:
    assert_that(build(p) | beam.Map(_describe), equal_to(expected))
  return expected


def _tv(value, seconds):
  return window.TimestampedValue(value, seconds)


def test_late_data_fires_late_panes_within_allowed_lateness(tmp_path):
  def build(p):
    stream = (
        TestStream()
        .add_elements([_tv(('k', 1), 1), _tv(('k', 2), 2)])
        .advance_watermark_to(12)
        .add_elements([_tv(('k', 3), 3), _tv(('k', 5), 14)])
        .advance_watermark_to(25)
        .add_elements([_tv(('k', 4), 4)])  # too late: past lateness 10
        .advance_watermark_to_infinity())
    return (
        p | stream
        | beam.WindowInto(
            window.FixedWindows(10), allowed_lateness=10,
            trigger=trigger.AfterWatermark(late=trigger.AfterCount(1)),
            accumulation_mode=trigger.AccumulationMode.ACCUMULATING)
        | beam.GroupByKey())

  expected = check_against_direct_runner(build, tmp_path)
  # On time [1, 2], late [1, 2, 3], and window [10, 20) on time; 4 dropped.
  assert len(expected) == 3


def test_early_firings_by_count_and_processing_time(tmp_path):
  def build(p):
    stream = (
        TestStream()
        .add_elements([_tv(('k', 1), 1)])
        .add_elements([_tv(('k', 2), 2)])
        .advance_processing_time(6)
        .add_elements([_tv(('k', 3), 3)])
        .advance_processing_time(6)
        .advance_watermark_to(30)
        .advance_watermark_to_infinity())
    return (
        p | stream
        | beam.WindowInto(
            window.FixedWindows(20),
            trigger=trigger.AfterWatermark(
                early=trigger.AfterProcessingTime(5)),
            accumulation_mode=trigger.AccumulationMode.DISCARDING)
        | beam.GroupByKey())

  check_against_direct_runner(build, tmp_path)


def test_sessions_merge_across_micro_batches(tmp_path):
  def build(p):
    stream = (
        TestStream()
        .add_elements([_tv(('a', 1), 1), _tv(('b', 1), 1)])
        .advance_watermark_to(3)
        .add_elements([_tv(('a', 2), 4)])  # joins a's session: [1, 9)
        .advance_watermark_to(8)
        .add_elements([_tv(('a', 3), 30)])  # a new session
        .advance_watermark_to_infinity())
    return (
        p | stream
        | beam.WindowInto(window.Sessions(5))
        | beam.CombinePerKey(sum))

  expected = check_against_direct_runner(build, tmp_path)
  assert len(expected) == 3


def test_repeated_count_trigger_in_global_window(tmp_path):
  def build(p):
    stream = (
        TestStream()
        .add_elements([_tv(('k', i), i) for i in range(3)])
        .advance_watermark_to(5)
        .add_elements([_tv(('k', i), i) for i in range(3, 5)])
        .advance_watermark_to_infinity())
    return (
        p | stream
        | beam.WindowInto(
            window.GlobalWindows(),
            trigger=trigger.Repeatedly(trigger.AfterCount(2)),
            accumulation_mode=trigger.AccumulationMode.DISCARDING)
        | beam.GroupByKey())

  check_against_direct_runner(build, tmp_path)


class _BufferUntilWindowEnd(beam.DoFn):
  """Bag state per key, flushed by an event-time timer at the end of each
  element's window: state and timers across micro-batches."""
  BUFFER = userstate.BagStateSpec('buffer', beam.coders.VarIntCoder())
  FLUSH = userstate.TimerSpec('flush', userstate.TimeDomain.WATERMARK)

  def process(self, element, w=beam.DoFn.WindowParam,
              buffer=beam.DoFn.StateParam(BUFFER),
              flush=beam.DoFn.TimerParam(FLUSH)):
    buffer.add(element[1])
    flush.set(w.max_timestamp())

  @userstate.on_timer(FLUSH)
  def on_flush(self, key=beam.DoFn.KeyParam,
               buffer=beam.DoFn.StateParam(BUFFER)):
    yield key, sorted(buffer.read())
    buffer.clear()


def test_state_and_event_time_timers_across_micro_batches(tmp_path):
  def build(p):
    stream = (
        TestStream()
        .add_elements([_tv(('a', 1), 1), _tv(('b', 2), 2)])
        .advance_watermark_to(5)
        .add_elements([_tv(('a', 3), 7)])
        .advance_watermark_to(12)  # [0, 10) ends: a -> [1, 3], b -> [2]
        .add_elements([_tv(('a', 4), 15)])
        .advance_watermark_to_infinity())
    return (
        p | stream
        | beam.WindowInto(window.FixedWindows(10))
        | beam.ParDo(_BufferUntilWindowEnd()))

  expected = check_against_direct_runner(build, tmp_path)
  assert sorted(e[0] for e in expected) == [
      ('a', [1, 3]), ('a', [4]), ('b', [2])]


class _OrderedSetAndFamily(beam.DoFn):
  """Ordered-list and set state, and a timer family with one timer per
  tag, kept across micro-batches."""
  ORDERED = userstate.OrderedListStateSpec('ordered', beam.coders.VarIntCoder())
  TAGS = userstate.SetStateSpec('tags', beam.coders.StrUtf8Coder())
  FAMILY = userstate.TimerSpec('family', userstate.TimeDomain.WATERMARK)

  def process(self, element, ts=beam.DoFn.TimestampParam,
              ordered=beam.DoFn.StateParam(ORDERED),
              tags=beam.DoFn.StateParam(TAGS),
              family=beam.DoFn.TimerParam(FAMILY)):
    tag, value = element[1]
    ordered.add((ts, value))
    tags.add(tag)
    family.set(Timestamp(100), dynamic_timer_tag=tag)

  @userstate.on_timer(FAMILY)
  def fire(self, key=beam.DoFn.KeyParam, tag=beam.DoFn.DynamicTimerTagParam,
           ts=beam.DoFn.TimestampParam,
           ordered=beam.DoFn.StateParam(ORDERED),
           tags=beam.DoFn.StateParam(TAGS)):
    yield (key, tag, int(ts), [v for _, v in ordered.read()],
           sorted(tags.read()))


def test_ordered_list_set_state_and_timer_families_across_micro_batches():
  # Beam's streaming DirectRunner has no ordered-list state or timer
  # families: the expected output is written out.
  stream = (
      TestStream()
      .add_elements([_tv(('k', ('x', 50)), 50), _tv(('k', ('y', 40)), 40)])
      .advance_watermark_to(30)
      .add_elements([_tv(('k', ('x', 35)), 35), _tv(('k', ('y', 60)), 60)])
      .advance_watermark_to(120)
      .add_elements([_tv(('k', ('z', 130)), 130)])
      .advance_watermark_to_infinity())
  with beam.Pipeline(PySparkRunner(), options=_streaming_options()) as p:
    fired = p | stream | beam.ParDo(_OrderedSetAndFamily())
    assert_that(fired, equal_to([
        ('k', 'x', 100, [35, 40, 50, 60], ['x', 'y']),
        ('k', 'y', 100, [35, 40, 50, 60], ['x', 'y']),
        # Set again after the first two fired: due at once.
        ('k', 'z', 100, [35, 40, 50, 60, 130], ['x', 'y', 'z']),
    ]))


class _CountThenFire(beam.DoFn):
  """Counts a key's elements; a processing-time timer reports the count."""
  COUNT = userstate.CombiningValueStateSpec('count', sum)
  REPORT = userstate.TimerSpec('report', userstate.TimeDomain.REAL_TIME)

  def process(self, element, count=beam.DoFn.StateParam(COUNT),
              report=beam.DoFn.TimerParam(REPORT)):
    count.add(1)
    report.set(Timestamp.now() + 3600)

  @userstate.on_timer(REPORT)
  def on_report(self, key=beam.DoFn.KeyParam,
                count=beam.DoFn.StateParam(COUNT)):
    yield key, count.read()


def test_processing_time_timers_fire_once_the_stream_ends():
  # An hour of processing time never passes in the test: the timers wait,
  # keeping their state across batches, and fire when the sources are
  # exhausted (as in batch), with every element counted.
  stream = (
      TestStream().add_elements([('a', 1), ('b', 1)])
      .advance_watermark_to(10).add_elements([('a', 2)])
      .advance_watermark_to_infinity())
  with beam.Pipeline(PySparkRunner(), options=_streaming_options()) as p:
    out = p | stream | beam.ParDo(_CountThenFire())
    assert_that(out, equal_to([('a', 2), ('b', 1)]))


def test_main_input_waits_for_its_side_input_window(tmp_path):
  # 'e' arrives before any side input: it is held back (and holds the
  # watermark) until the side input's watermark passes the window.
  def build(p):
    stream = p | (
        TestStream()
        .advance_watermark_to(10, tag='main')
        .add_elements(['e'], tag='main')
        .advance_watermark_to(5, tag='side')
        .add_elements([_tv(2, 2)], tag='side')
        .advance_watermark_to(8, tag='side')
        .add_elements([_tv(7, 7)], tag='side')
        .advance_watermark_to_infinity(tag='side')
        .advance_watermark_to_infinity(tag='main'))
    return stream['main'] | beam.Map(
        lambda e, side: (e, sorted(side)), beam.pvalue.AsList(stream['side']))

  expected = check_against_direct_runner(build, tmp_path)
  assert [e[0] for e in expected] == [('e', [2, 7])]


def test_windowed_value_holders_keep_timestamps():
  # A TestStream element given as a WindowedValue keeps its timestamp (its
  # window cannot survive the PCollection's global window coder; see
  # tests/test_streaming_suites.py).
  holder = WindowedValueHolder(
      WindowedValue('a', Timestamp(5), [window.IntervalWindow(5, 10)]))
  with beam.Pipeline(PySparkRunner(), options=_streaming_options()) as p:
    out = (
        p | TestStream().add_elements([holder]).advance_watermark_to(20)
        | beam.WindowInto(window.FixedWindows(5))
        | beam.Map(lambda e, ts=beam.DoFn.TimestampParam,
                   w=beam.DoFn.WindowParam: (e, ts, w)))
    assert_that(out, equal_to([('a', Timestamp(5),
                                window.IntervalWindow(5, 10))]))


class _SlowOnSecond(beam.DoFn):
  def __init__(self, started):
    self.started = started

  def process(self, element):
    if element == 2:
      open(self.started, 'w').close()
      time.sleep(2)
    yield element


def test_cancel_stops_between_micro_batches(tmp_path):
  started = str(tmp_path / 'started')
  events = TestStream()
  for i in range(1, 40):
    events = events.add_elements([i]).advance_watermark_to(i)
  p = beam.Pipeline(PySparkRunner(), options=_streaming_options())
  _ = p | events.advance_watermark_to_infinity() | beam.ParDo(
      _SlowOnSecond(started))
  result = p.run()
  deadline = time.monotonic() + 120
  while not os.path.exists(started) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert os.path.exists(started), 'the second micro-batch never ran'
  result.cancel()
  state = result.wait_until_finish(duration=120 * 1000)
  assert state == PipelineState.CANCELLED


def test_bounded_and_test_stream_sources_together(tmp_path):
  # A bounded side of the pipeline (Create) joins a TestStream: its one
  # batch is in the first wave, then its watermark is +inf.
  def build(p):
    words = p | 'Words' >> beam.Create([('a', 'x'), ('b', 'y')])
    stream = p | TestStream().add_elements([('a', 1)]).advance_watermark_to(
        5).add_elements([('b', 2), ('a', 3)]).advance_watermark_to_infinity()
    return ((words, stream) | beam.Flatten()
            | beam.GroupByKey()
            | beam.MapTuple(lambda k, vs: (k, sorted(map(str, vs)))))

  check_against_direct_runner(build, tmp_path)

