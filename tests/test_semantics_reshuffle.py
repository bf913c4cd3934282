"""Reshuffle on local[2]: elements, timestamps and windows are preserved."""

import os

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import trigger
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp

from conftest import Observe
from conftest import ObservePane
from conftest import sort_all

SEC = 1_000_000


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


def test_reshuffle_preserves_elements():
  with beam.Pipeline(options=options()) as p:
    out = (
        p | beam.Create(range(2000))
        | beam.Map(lambda x: (x % 7, x))
        | beam.Reshuffle())
    assert_that(out, equal_to([(x % 7, x) for x in range(2000)]))


def test_reshuffle_preserves_duplicates(collect):
  def build(p):
    return p | beam.Create([1, 1, 2, 2, 2, 3, 'x', 'x']) | beam.Reshuffle()

  assert collect.spark(build) == sort_all([1, 1, 2, 2, 2, 3, 'x', 'x'])


def test_reshuffle_preserves_timestamps_and_fixed_windows(collect):
  # Millisecond timestamps (the data channel's precision).
  events = [(i, 1234 + i * 3500) for i in range(60)]

  def build(p):
    return (
        p | beam.Create(events)
        | beam.Map(
            lambda e: window.TimestampedValue(e[0], Timestamp(micros=e[1] * 1000)))
        | beam.WindowInto(window.FixedWindows(10))
        | beam.Reshuffle()
        | beam.ParDo(Observe()))

  expected = []
  for value, millis in events:
    micros = millis * 1000
    start = millis // 10000 * 10
    expected.append((value, micros, ('interval', start * SEC,
                                      (start + 10) * SEC)))
  expected = sort_all(expected)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_reshuffle_preserves_sliding_windows_and_global_timestamps(collect):
  def build(p):
    stamped = (
        p | beam.Create([(i, i * 2) for i in range(20)])
        | beam.Map(lambda e: window.TimestampedValue(e[0], e[1])))
    sliding = (
        stamped | 'Sliding' >> beam.WindowInto(window.SlidingWindows(6, 3))
        | 'ReshuffleSliding' >> beam.Reshuffle()
        | 'ObserveSliding' >> beam.ParDo(Observe())
        | 'Rewindow' >> beam.WindowInto(window.GlobalWindows()))
    global_ = (
        stamped | 'ReshuffleGlobal' >> beam.Reshuffle()
        | 'ObserveGlobal' >> beam.ParDo(Observe()))
    return (sliding, global_) | beam.Flatten()

  expected = []
  for i in range(20):
    ts = i * 2
    expected.append((i, ts * SEC, ('global', )))
    last = ts - ts % 3
    for start in (last - 3, last):
      expected.append((i, ts * SEC, ('interval', start * SEC,
                                      (start + 6) * SEC)))
  expected = sort_all(expected)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_reshuffle_after_windowed_group(collect):
  # Grouped output (end-of-window timestamps, session windows) survives.
  def build(p):
    return (
        p | beam.Create([('a', 1), ('a', 3), ('b', 2), ('a', 20)])
        | beam.Map(lambda e: window.TimestampedValue(e, e[1]))
        | beam.WindowInto(window.Sessions(5))
        | beam.GroupByKey()
        | beam.MapTuple(lambda k, vs: (k, sorted(vs)))
        | beam.Reshuffle()
        | beam.ParDo(Observe()))

  expected = sort_all([
      (('a', [1, 3]), 8 * SEC - 1000, ('interval', 1 * SEC, 8 * SEC)),
      (('b', [2]), 7 * SEC - 1000, ('interval', 2 * SEC, 7 * SEC)),
      (('a', [20]), 25 * SEC - 1000, ('interval', 20 * SEC, 25 * SEC)),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_reshuffle_after_triggered_group_keeps_panes(collect):
  def build(p):
    return (
        p | beam.Create([('a', 1), ('a', 3), ('b', 2)])
        | beam.Map(lambda e: window.TimestampedValue(e, e[1]))
        | beam.WindowInto(
            window.FixedWindows(10),
            trigger=trigger.AfterWatermark(early=trigger.AfterCount(1)),
            accumulation_mode=trigger.AccumulationMode.ACCUMULATING)
        | beam.GroupByKey()
        | beam.MapTuple(lambda k, vs: (k, sorted(vs)))
        | beam.Reshuffle()
        | beam.ParDo(ObservePane()))

  actual, reference = collect.both(build)
  assert actual == reference
  assert len(actual) == 4  # an early and an on-time pane per key


class _KeyBy(beam.DoFn):
  def __init__(self, kind):
    self.kind = kind

  def process(self, i):
    import key_types
    yield key_types.keys(self.kind, i), i


# (A frozenset key is left out: Beam's own DirectRunner refuses it in this
# pipeline, "Unable to deterministically encode 'frozenset({0, 7})'".)
@pytest.mark.parametrize('kind', ['namedtuple', 'dataclass', 'enum', 'tuple'])
def test_keys_the_sdk_encodes_itself_survive_reshuffle_then_group(kind):
  # The hardening issue, defect 10: a NamedTuple key through Reshuffle then
  # GroupByKey failed decoding ("Unknown type tag 80"): the Reshuffle's
  # output coder differs from its input's, and the runner moved the input
  # coder's bytes.
  import key_types
  expected = {}
  for i in range(6):
    expected.setdefault(key_types.keys(kind, i), []).append(i)
  with beam.Pipeline(options=options()) as p:
    out = (p | beam.Create(range(6)) | beam.ParDo(_KeyBy(kind))
           | beam.Reshuffle() | beam.GroupByKey()
           | beam.MapTuple(lambda k, vs: (repr(k), sorted(vs))))
    assert_that(out, equal_to(
        [(repr(k), sorted(v)) for k, v in expected.items()]))


def test_a_reshuffle_nothing_reads_still_runs_what_it_reshuffles(tmp_path):
  # Beam's Go regression test LPErrorReshufflePipeline ends in a Reshuffle
  # whose output nothing reads; its stage has no output (it failed with
  # "not enough values to unpack"). What it reshuffles still runs.
  seen = str(tmp_path)

  def mark(x):
    import os  # pylint: disable=import-outside-toplevel,reimported
    open(os.path.join(seen, str(x)), 'w', encoding='utf-8').close()
    return x

  with beam.Pipeline(options=options()) as p:
    _ = p | beam.Create([1, 2, 3]) | beam.Map(mark) | beam.Reshuffle()
  assert sorted(os.listdir(seen)) == ['1', '2', '3']
