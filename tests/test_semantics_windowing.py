"""GroupByKey with windowing on local[2].

Every test checks our runner's output against Beam's FnApiRunner and, where
the result is easy to state, against hand-computed expectations: windows,
output timestamps and panes are observed with DoFn parameters.
"""

import collections

import apache_beam as beam
from apache_beam.coders import coders
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import trigger
from apache_beam.transforms import window
from apache_beam.transforms.window import TimestampCombiner
from apache_beam.utils.timestamp import MAX_TIMESTAMP

from conftest import ObservePane
from conftest import sort_all

SEC = 1_000_000  # micros

# (key, value, event time in seconds)
EVENTS = [
    ('a', 1, 1),
    ('a', 2, 4),
    ('a', 3, 12),
    ('b', 4, 3),
    ('b', 5, 25),
    ('a', 6, 27),
    ('b', 7, 28),
    ('a', 8, 45),
]

ON_TIME_ONLY_PANE = (True, True, int(beam.utils.windowed_value.PaneInfoTiming.ON_TIME), 0, 0)


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


def stamped(p, events=EVENTS):
  return (
      p | 'Events' >> beam.Create(events)
      | 'Stamp' >> beam.Map(
          lambda e: window.TimestampedValue((e[0], e[1]), e[2])))


def grouped(pcoll):
  return (
      pcoll | beam.GroupByKey()
      | 'Sort' >> beam.MapTuple(lambda k, vs: (k, sorted(vs)))
      | beam.ParDo(ObservePane()))


def iw(start, end):
  return ('interval', start * SEC, end * SEC)


def expected_groups(assign, combiner='eow', events=EVENTS):
  """Hand-computed GBK output for a non-merging assignment.

  ``assign(ts) -> [(start, end)]`` in seconds.
  """
  groups = collections.defaultdict(list)
  for k, v, ts in events:
    for start, end in assign(ts):
      groups[(k, start, end)].append((v, ts))
  out = []
  for (k, start, end), vts in groups.items():
    if combiner == 'eow':
      out_ts = end * SEC - 1
    elif combiner == 'earliest':
      out_ts = min(t for _, t in vts) * SEC
    else:
      out_ts = max(t for _, t in vts) * SEC
    out.append(((k, sorted(v for v, _ in vts)), out_ts, iw(start, end),
                ON_TIME_ONLY_PANE))
  return sort_all(out)


# -- user window functions (module level: pickled by reference) --------------


class NestedBlockWindows(window.NonMergingWindowFn):
  """Each element in two windows: [s, s+size) and [s, s+2*size)."""
  def __init__(self, size):
    self.size = size

  def assign(self, context):
    seconds = int(context.timestamp)
    start = seconds - seconds % self.size
    return [
        window.IntervalWindow(start, start + self.size),
        window.IntervalWindow(start, start + 2 * self.size),
    ]

  def get_window_coder(self):
    return coders.IntervalWindowCoder()

  def __eq__(self, other):
    return type(self) == type(other) and self.size == other.size

  def __hash__(self):
    return hash((type(self), self.size))


class BlockMergingWindows(window.WindowFn):
  """[t, t+1) per element; windows starting in the same block merge."""
  def __init__(self, block):
    self.block = block

  def assign(self, context):
    seconds = int(context.timestamp)
    return [window.IntervalWindow(seconds, seconds + 1)]

  def merge(self, merge_context):
    by_block = collections.defaultdict(list)
    for w in merge_context.windows:
      by_block[int(w.start) // self.block].append(w)
    for windows in by_block.values():
      if len(windows) > 1:
        merge_context.merge(
            windows,
            window.IntervalWindow(
                min(w.start for w in windows), max(w.end for w in windows)))

  def get_window_coder(self):
    return coders.IntervalWindowCoder()

  def __eq__(self, other):
    return type(self) == type(other) and self.block == other.block

  def __hash__(self):
    return hash((type(self), self.block))


# -- tests ---------------------------------------------------------------------


def test_gbk_global_window_many_keys(collect):
  def build(p):
    return grouped(
        p | beam.Create([(f'k{i % 37}', i) for i in range(500)]))

  expected = sort_all([((f'k{k}', sorted(i for i in range(500) if i % 37 == k)),
                        MAX_TIMESTAMP.micros and
                        window.GlobalWindow().max_timestamp().micros,
                        ('global', ), ON_TIME_ONLY_PANE) for k in range(37)])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_global_window_with_non_default_timestamp_combiner(collect):
  def build(p):
    return grouped(
        stamped(p) | beam.WindowInto(
            window.GlobalWindows(),
            timestamp_combiner=TimestampCombiner.OUTPUT_AT_EARLIEST))

  actual, reference = collect.both(build)
  assert actual == reference
  assert sort_all((e[0], e[1]) for e in actual) == sort_all([
      (('a', [1, 2, 3, 6, 8]), 1 * SEC),
      (('b', [4, 5, 7]), 3 * SEC),
  ])


def test_gbk_fixed_windows(collect):
  def build(p):
    return grouped(stamped(p) | beam.WindowInto(window.FixedWindows(10)))

  expected = expected_groups(lambda t: [(t - t % 10, t - t % 10 + 10)])
  # Spelled out, to check the helper itself.
  assert [e[0] for e in expected] == sort_all([
      ('a', [1, 2]), ('a', [3]), ('a', [6]), ('a', [8]), ('b', [4]),
      ('b', [5, 7])
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_sliding_windows(collect):
  def build(p):
    return grouped(stamped(p) | beam.WindowInto(window.SlidingWindows(10, 5)))

  def assign(t):
    last = t - t % 5
    return [(s, s + 10) for s in (last - 5, last)]

  expected = expected_groups(assign)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_sessions_merge(collect):
  def build(p):
    return grouped(stamped(p) | beam.WindowInto(window.Sessions(5)))

  expected = sort_all([
      (('a', [1, 2]), 9 * SEC - 1, iw(1, 9), ON_TIME_ONLY_PANE),
      (('a', [3]), 17 * SEC - 1, iw(12, 17), ON_TIME_ONLY_PANE),
      (('a', [6]), 32 * SEC - 1, iw(27, 32), ON_TIME_ONLY_PANE),
      (('a', [8]), 50 * SEC - 1, iw(45, 50), ON_TIME_ONLY_PANE),
      (('b', [4]), 8 * SEC - 1, iw(3, 8), ON_TIME_ONLY_PANE),
      (('b', [5, 7]), 33 * SEC - 1, iw(25, 33), ON_TIME_ONLY_PANE),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_sessions_many_keys_spread_over_partitions(collect):
  # 40 keys, each with two sessions; several elements per session.
  events = []
  for k in range(40):
    for ts in (k, k + 2, k + 4, k + 100, k + 103):
      events.append((f'key{k}', ts * 10 + k % 3, ts))

  def build(p):
    return grouped(
        stamped(p, events) | beam.WindowInto(window.Sessions(3)))

  expected = []
  for k in range(40):
    key = f'key{k}'
    vs = lambda tss: sorted(t * 10 + k % 3 for t in tss)
    expected.append(((key, vs((k, k + 2, k + 4))), (k + 7) * SEC - 1,
                     iw(k, k + 7), ON_TIME_ONLY_PANE))
    expected.append(((key, vs((k + 100, k + 103))), (k + 106) * SEC - 1,
                     iw(k + 100, k + 106), ON_TIME_ONLY_PANE))
  expected = sort_all(expected)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_custom_non_merging_window_fn(collect):
  def build(p):
    return grouped(stamped(p) | beam.WindowInto(NestedBlockWindows(10)))

  def assign(t):
    s = t - t % 10
    return [(s, s + 10), (s, s + 20)]

  expected = expected_groups(assign)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_custom_merging_window_fn(collect):
  def build(p):
    return grouped(stamped(p) | beam.WindowInto(BlockMergingWindows(20)))

  expected = sort_all([
      (('a', [1, 2, 3]), 13 * SEC - 1, iw(1, 13), ON_TIME_ONLY_PANE),
      (('a', [6]), 28 * SEC - 1, iw(27, 28), ON_TIME_ONLY_PANE),
      (('a', [8]), 46 * SEC - 1, iw(45, 46), ON_TIME_ONLY_PANE),
      (('b', [4]), 4 * SEC - 1, iw(3, 4), ON_TIME_ONLY_PANE),
      (('b', [5, 7]), 29 * SEC - 1, iw(25, 29), ON_TIME_ONLY_PANE),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def _fixed_with_combiner(combiner):
  def build(p):
    return grouped(
        stamped(p)
        | beam.WindowInto(window.FixedWindows(10), timestamp_combiner=combiner))

  return build


def test_gbk_timestamp_combiner_output_at_earliest(collect):
  build = _fixed_with_combiner(TimestampCombiner.OUTPUT_AT_EARLIEST)
  expected = expected_groups(
      lambda t: [(t - t % 10, t - t % 10 + 10)], combiner='earliest')
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_timestamp_combiner_output_at_latest(collect):
  build = _fixed_with_combiner(TimestampCombiner.OUTPUT_AT_LATEST)
  expected = expected_groups(
      lambda t: [(t - t % 10, t - t % 10 + 10)], combiner='latest')
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_timestamp_combiner_output_at_eow(collect):
  build = _fixed_with_combiner(TimestampCombiner.OUTPUT_AT_EOW)
  expected = expected_groups(lambda t: [(t - t % 10, t - t % 10 + 10)])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_sessions_with_output_at_earliest(collect):
  def build(p):
    return grouped(
        stamped(p) | beam.WindowInto(
            window.Sessions(5),
            timestamp_combiner=TimestampCombiner.OUTPUT_AT_EARLIEST))

  expected = sort_all([
      (('a', [1, 2]), 1 * SEC, iw(1, 9), ON_TIME_ONLY_PANE),
      (('a', [3]), 12 * SEC, iw(12, 17), ON_TIME_ONLY_PANE),
      (('a', [6]), 27 * SEC, iw(27, 32), ON_TIME_ONLY_PANE),
      (('a', [8]), 45 * SEC, iw(45, 50), ON_TIME_ONLY_PANE),
      (('b', [4]), 3 * SEC, iw(3, 8), ON_TIME_ONLY_PANE),
      (('b', [5, 7]), 25 * SEC, iw(25, 33), ON_TIME_ONLY_PANE),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_regroup_keeps_windows(collect):
  # Grouping twice: the second GroupByKey sees the first one's windows and
  # end-of-window timestamps.
  def build(p):
    return (
        stamped(p) | beam.WindowInto(window.FixedWindows(10))
        | 'First' >> beam.GroupByKey()
        | beam.MapTuple(lambda k, vs: ('all', (k, sum(vs))))
        | 'Second' >> beam.GroupByKey()
        | 'Sort' >> beam.MapTuple(lambda k, vs: (k, sorted(vs)))
        | beam.ParDo(ObservePane()))

  expected = sort_all([
      (('all', [('a', 3), ('b', 4)]), 10 * SEC - 1, iw(0, 10),
       ON_TIME_ONLY_PANE),
      (('all', [('a', 3)]), 20 * SEC - 1, iw(10, 20), ON_TIME_ONLY_PANE),
      (('all', [('a', 6), ('b', 12)]), 30 * SEC - 1, iw(20, 30),
       ON_TIME_ONLY_PANE),
      (('all', [('a', 8)]), 50 * SEC - 1, iw(40, 50), ON_TIME_ONLY_PANE),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


# -- batch triggers: compared with the FnApiRunner ----------------------------


def test_gbk_trigger_early_firings_accumulating(collect):
  def build(p):
    return grouped(
        stamped(p) | beam.WindowInto(
            window.FixedWindows(10),
            trigger=trigger.AfterWatermark(early=trigger.AfterCount(1)),
            accumulation_mode=trigger.AccumulationMode.ACCUMULATING))

  actual, reference = collect.both(build)
  assert actual == reference
  # Every window's final pane holds all of its elements.
  finals = sort_all(e[0] for e in actual if e[3][1])
  assert finals == [e[0] for e in expected_groups(
      lambda t: [(t - t % 10, t - t % 10 + 10)])]


def test_gbk_trigger_repeated_after_count_discarding(collect):
  events = [(f'k{i % 3}', i, i) for i in range(30)]

  def build(p):
    return grouped(
        stamped(p, events) | beam.WindowInto(
            window.GlobalWindows(),
            trigger=trigger.Repeatedly(trigger.AfterCount(3)),
            accumulation_mode=trigger.AccumulationMode.DISCARDING))

  actual, reference = collect.both(build)
  assert actual == reference
  # Discarding: the panes of a key partition its values.
  by_key = collections.defaultdict(list)
  for (k, vs), _, _, _ in actual:
    by_key[k].extend(vs)
  assert {k: sorted(v) for k, v in by_key.items()} == {
      f'k{j}': [i for i in range(30) if i % 3 == j] for j in range(3)}


def test_gbk_trigger_after_processing_time_or_count_accumulating(collect):
  def build(p):
    return grouped(
        stamped(p) | beam.WindowInto(
            window.Sessions(5),
            trigger=trigger.AfterWatermark(
                early=trigger.AfterCount(2), late=trigger.AfterCount(1)),
            accumulation_mode=trigger.AccumulationMode.ACCUMULATING,
            allowed_lateness=100))

  actual, reference = collect.both(build)
  assert actual == reference
