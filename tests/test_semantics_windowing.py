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
from apache_beam.utils.timestamp import Timestamp

from conftest import ObservePane
from conftest import sort_all

SEC = 1_000_000  # micros
# Element timestamps cross the data channel in milliseconds: a window's
# max_timestamp (end - 1us) arrives as end - 1ms.
EOW = -1000
GLOBAL_MAX_MILLIS = window.GlobalWindow().max_timestamp().micros // 1000

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

_ON_TIME = int(beam.utils.windowed_value.PaneInfoTiming.ON_TIME)
# The default windowing's single pane.
ON_TIME_ONLY_PANE = (True, True, _ON_TIME, 0, 0)
# Beam's batch trigger driver (any other windowing) fires one on-time pane
# per window, not marked last (as the FnApiRunner does).
BATCH_PANE = (True, False, _ON_TIME, 0, 0)


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
      out_ts = end * SEC + EOW
    elif combiner == 'earliest':
      out_ts = min(t for _, t in vts) * SEC
    else:
      out_ts = max(t for _, t in vts) * SEC
    out.append(((k, sorted(v for v, _ in vts)), out_ts, iw(start, end),
                BATCH_PANE))
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


class ParityWindow(window.BoundedWindow):
  """A user window type (not an IntervalWindow): element parity + end."""
  def __init__(self, parity, end):
    super().__init__(end)
    self.parity = parity

  def __eq__(self, other):
    return isinstance(other, ParityWindow) and (
        (self.parity, self.end) == (other.parity, other.end))

  def __hash__(self):
    return hash((self.parity, self.end))

  def __repr__(self):
    return f'ParityWindow({self.parity}, {self.end.micros})'


class ParityWindowCoder(coders.Coder):
  def encode(self, w):
    return f'{w.parity}:{w.end.micros}'.encode()

  def decode(self, encoded):
    parity, end = encoded.decode().split(':')
    return ParityWindow(int(parity), Timestamp(micros=int(end)))

  def is_deterministic(self):
    return True


class ParityWindows(window.NonMergingWindowFn):
  """Even and odd values in separate windows, each ending at `end` s."""
  def __init__(self, end):
    self.end = end

  def assign(self, context):
    return [ParityWindow(context.element[1] % 2, Timestamp(self.end))]

  def get_window_coder(self):
    return ParityWindowCoder()


# -- tests ---------------------------------------------------------------------


def test_gbk_global_window_many_keys(collect):
  def build(p):
    return grouped(
        p | beam.Create([(f'k{i % 37}', i) for i in range(500)]))

  expected = sort_all([((f'k{k}', sorted(i for i in range(500) if i % 37 == k)),
                        GLOBAL_MAX_MILLIS * 1000,
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
      (('a', [1, 2]), 9 * SEC + EOW, iw(1, 9), BATCH_PANE),
      (('a', [3]), 17 * SEC + EOW, iw(12, 17), BATCH_PANE),
      (('a', [6]), 32 * SEC + EOW, iw(27, 32), BATCH_PANE),
      (('a', [8]), 50 * SEC + EOW, iw(45, 50), BATCH_PANE),
      (('b', [4]), 8 * SEC + EOW, iw(3, 8), BATCH_PANE),
      (('b', [5, 7]), 33 * SEC + EOW, iw(25, 33), BATCH_PANE),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_sessions_many_keys_spread_over_partitions(collect):
  # 40 keys, each with two sessions of overlapping [t, t+3) windows.
  events = []
  for k in range(40):
    for ts in (k, k + 2, k + 4, k + 100, k + 102):
      events.append((f'key{k}', ts * 10 + k % 3, ts))

  def build(p):
    return grouped(
        stamped(p, events) | beam.WindowInto(window.Sessions(3)))

  expected = []
  for k in range(40):
    key = f'key{k}'
    vs = lambda tss: sorted(t * 10 + k % 3 for t in tss)
    expected.append(((key, vs((k, k + 2, k + 4))), (k + 7) * SEC + EOW,
                     iw(k, k + 7), BATCH_PANE))
    expected.append(((key, vs((k + 100, k + 102))), (k + 105) * SEC + EOW,
                     iw(k + 100, k + 105), BATCH_PANE))
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
      (('a', [1, 2, 3]), 13 * SEC + EOW, iw(1, 13), BATCH_PANE),
      (('a', [6]), 28 * SEC + EOW, iw(27, 28), BATCH_PANE),
      (('a', [8]), 46 * SEC + EOW, iw(45, 46), BATCH_PANE),
      (('b', [4]), 4 * SEC + EOW, iw(3, 4), BATCH_PANE),
      (('b', [5, 7]), 29 * SEC + EOW, iw(25, 29), BATCH_PANE),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_gbk_custom_window_type_and_coder(collect):
  def build(p):
    return grouped(stamped(p) | beam.WindowInto(ParityWindows(100)))

  def pw(parity):
    return ('ParityWindow', f'ParityWindow({parity}, {100 * SEC})',
            100 * SEC - 1)

  expected = sort_all([
      (('a', [1, 3]), 100 * SEC + EOW, pw(1), BATCH_PANE),
      (('a', [2, 6, 8]), 100 * SEC + EOW, pw(0), BATCH_PANE),
      (('b', [5, 7]), 100 * SEC + EOW, pw(1), BATCH_PANE),
      (('b', [4]), 100 * SEC + EOW, pw(0), BATCH_PANE),
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
      (('a', [1, 2]), 1 * SEC, iw(1, 9), BATCH_PANE),
      (('a', [3]), 12 * SEC, iw(12, 17), BATCH_PANE),
      (('a', [6]), 27 * SEC, iw(27, 32), BATCH_PANE),
      (('a', [8]), 45 * SEC, iw(45, 50), BATCH_PANE),
      (('b', [4]), 3 * SEC, iw(3, 8), BATCH_PANE),
      (('b', [5, 7]), 25 * SEC, iw(25, 33), BATCH_PANE),
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
      (('all', [('a', 3), ('b', 4)]), 10 * SEC + EOW, iw(0, 10),
       BATCH_PANE),
      (('all', [('a', 3)]), 20 * SEC + EOW, iw(10, 20), BATCH_PANE),
      (('all', [('a', 6), ('b', 12)]), 30 * SEC + EOW, iw(20, 30),
       BATCH_PANE),
      (('all', [('a', 8)]), 50 * SEC + EOW, iw(40, 50), BATCH_PANE),
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


def test_gbk_trigger_sessions_early_and_late_firings_accumulating(collect):
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
