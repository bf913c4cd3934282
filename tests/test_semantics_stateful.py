"""Stateful DoFns and timers on local[2], with many keys over 2 partitions.

State kinds: bag, combining value, set, read-modify-write, ordered list.
Timers: event time, processing time (both fire at the end of input in batch),
a timer that re-sets itself, dynamic timer families, cleared timers.

Expectations are order independent (a key's elements may arrive in any
order), computed by hand and also checked against the FnApiRunner.
"""

import apache_beam as beam
from apache_beam.coders import coders
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import combiners
from apache_beam.transforms import window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec
from apache_beam.transforms.userstate import CombiningValueStateSpec
from apache_beam.transforms.userstate import OrderedListStateSpec
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec
from apache_beam.transforms.userstate import SetStateSpec
from apache_beam.transforms.userstate import TimerSpec
from apache_beam.transforms.userstate import on_timer
from apache_beam.utils.timestamp import Duration
from apache_beam.utils.timestamp import Timestamp

from conftest import sort_all

SEC = 1_000_000
NUM_KEYS = 40
KEYS = [f'k{i}' for i in range(NUM_KEYS)]


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


def keyed_input(p, per_key=lambda i: i % 5 + 1, label='Input'):
  """(key, value) with key k<i> holding values 0 .. per_key(i) - 1."""
  data = [(f'k{i}', v) for i in range(NUM_KEYS) for v in range(per_key(i))]
  return (
      p | label >> beam.Create(data)
      | label + 'Spread' >> beam.Reshuffle())


def count_of(i):
  return i % 5 + 1


# -- DoFns (module level: pickled by reference) -------------------------------


def max_or_zero(values):
  return max(values, default=0)


class BagCount(beam.DoFn):
  """Emits (key, bag size after adding) per element: 1..n per key."""
  BAG = BagStateSpec('bag', coders.VarIntCoder())

  def process(self, kv, bag=beam.DoFn.StateParam(BAG)):
    bag.add(kv[1])
    yield kv[0], len(list(bag.read()))


class BagFlushAtEndOfWindow(beam.DoFn):
  """Buffers values; an end-of-window timer emits them with their window."""
  BAG = BagStateSpec('bag', coders.VarIntCoder())
  FLUSH = TimerSpec('flush', TimeDomain.WATERMARK)

  def process(
      self,
      kv,
      w=beam.DoFn.WindowParam,
      bag=beam.DoFn.StateParam(BAG),
      flush=beam.DoFn.TimerParam(FLUSH)):
    bag.add(kv[1])
    flush.set(w.max_timestamp())

  @on_timer(FLUSH)
  def on_flush(
      self,
      key=beam.DoFn.KeyParam,
      w=beam.DoFn.WindowParam,
      ts=beam.DoFn.TimestampParam,
      bag=beam.DoFn.StateParam(BAG)):
    values = sorted(bag.read())
    bag.clear()
    if isinstance(w, window.IntervalWindow):
      yield key, values, int(w.start), int(w.end), ts.micros
    else:
      yield key, values, 'global', None, ts.micros


class CombiningSum(beam.DoFn):
  """Sums with combining state; a count state gives 1..n per element."""
  TOTAL = CombiningValueStateSpec('total', sum)
  COUNT = CombiningValueStateSpec('count', combiners.CountCombineFn())
  FLUSH = TimerSpec('flush', TimeDomain.WATERMARK)

  def process(
      self,
      kv,
      w=beam.DoFn.WindowParam,
      total=beam.DoFn.StateParam(TOTAL),
      count=beam.DoFn.StateParam(COUNT),
      flush=beam.DoFn.TimerParam(FLUSH)):
    total.add(kv[1])
    count.add(kv[1])
    flush.set(w.max_timestamp())
    yield 'count', kv[0], count.read()

  @on_timer(FLUSH)
  def on_flush(
      self, key=beam.DoFn.KeyParam, total=beam.DoFn.StateParam(TOTAL)):
    yield 'total', key, total.read()


class DistinctWithSetState(beam.DoFn):
  SEEN = SetStateSpec('seen', coders.StrUtf8Coder())
  FLUSH = TimerSpec('flush', TimeDomain.WATERMARK)

  def process(
      self,
      kv,
      w=beam.DoFn.WindowParam,
      seen=beam.DoFn.StateParam(SEEN),
      flush=beam.DoFn.TimerParam(FLUSH)):
    seen.add(kv[1])
    flush.set(w.max_timestamp())

  @on_timer(FLUSH)
  def on_flush(self, key=beam.DoFn.KeyParam, seen=beam.DoFn.StateParam(SEEN)):
    yield key, sorted(seen.read())


class ReadModifyWriteCounter(beam.DoFn):
  COUNTER = ReadModifyWriteStateSpec('counter', coders.VarIntCoder())

  def process(self, kv, counter=beam.DoFn.StateParam(COUNTER)):
    current = (counter.read() or 0) + 1
    counter.write(current)
    yield kv[0], current


class OrderedListByTimestamp(beam.DoFn):
  """Adds (element timestamp, value); emits the ordered list and a range."""
  LIST = OrderedListStateSpec('list', coders.VarIntCoder())
  FLUSH = TimerSpec('flush', TimeDomain.WATERMARK)

  def process(
      self,
      kv,
      ts=beam.DoFn.TimestampParam,
      w=beam.DoFn.WindowParam,
      ordered=beam.DoFn.StateParam(LIST),
      flush=beam.DoFn.TimerParam(FLUSH)):
    ordered.add((ts, kv[1]))
    flush.set(w.max_timestamp())

  @on_timer(FLUSH)
  def on_flush(self, key=beam.DoFn.KeyParam, ordered=beam.DoFn.StateParam(LIST)):
    everything = [(t.micros // SEC, v) for t, v in ordered.read()]
    middle = [(t.micros // SEC, v)
              for t, v in ordered.read_range(Timestamp(10), Timestamp(20))]
    ordered.clear_range(Timestamp(0), Timestamp(10))
    after_clear = [(t.micros // SEC, v) for t, v in ordered.read()]
    yield key, everything, middle, after_clear


class EventTimeTimer(beam.DoFn):
  """A timer 5 s after the key's latest element; emits count and time."""
  BAG = BagStateSpec('bag', coders.VarIntCoder())
  LATEST = CombiningValueStateSpec('latest', max_or_zero)
  TIMER = TimerSpec('timer', TimeDomain.WATERMARK)

  def process(
      self,
      kv,
      ts=beam.DoFn.TimestampParam,
      bag=beam.DoFn.StateParam(BAG),
      latest=beam.DoFn.StateParam(LATEST),
      timer=beam.DoFn.TimerParam(TIMER)):
    bag.add(kv[1])
    latest.add(ts.micros // SEC)
    timer.set(Timestamp(latest.read() + 5))

  @on_timer(TIMER)
  def fired(
      self,
      key=beam.DoFn.KeyParam,
      ts=beam.DoFn.TimestampParam,
      bag=beam.DoFn.StateParam(BAG)):
    yield key, sorted(bag.read()), ts.micros


class ProcessingTimeTimer(beam.DoFn):
  """A processing-time timer per key; in batch it fires at end of input."""
  BAG = BagStateSpec('bag', coders.VarIntCoder())
  TIMER = TimerSpec('timer', TimeDomain.REAL_TIME)

  def process(
      self,
      kv,
      bag=beam.DoFn.StateParam(BAG),
      timer=beam.DoFn.TimerParam(TIMER)):
    bag.add(kv[1])
    timer.set(Timestamp.now() + Duration(seconds=1))

  @on_timer(TIMER)
  def fired(self, key=beam.DoFn.KeyParam, bag=beam.DoFn.StateParam(BAG)):
    yield key, sorted(bag.read())


class LoopingTimer(beam.DoFn):
  """A timer that re-sets itself 10 s later until it has fired `times`."""
  FIRED = ReadModifyWriteStateSpec('fired', coders.VarIntCoder())
  TIMER = TimerSpec('loop', TimeDomain.WATERMARK)

  def __init__(self, times):
    self.times = times

  def process(
      self, kv, fired=beam.DoFn.StateParam(FIRED),
      timer=beam.DoFn.TimerParam(TIMER)):
    fired.write(0)
    timer.set(Timestamp(10))

  @on_timer(TIMER)
  def tick(
      self,
      key=beam.DoFn.KeyParam,
      ts=beam.DoFn.TimestampParam,
      fired=beam.DoFn.StateParam(FIRED),
      timer=beam.DoFn.TimerParam(TIMER)):
    count = fired.read() + 1
    fired.write(count)
    yield key, count, ts.micros // SEC
    if count < self.times:
      timer.set(ts + Duration(seconds=10))


class DynamicTimers(beam.DoFn):
  """One timer per tag of a family; tag 'cancelled' is set then cleared."""
  TIMERS = TimerSpec('family', TimeDomain.WATERMARK)

  def process(self, kv, timers=beam.DoFn.TimerParam(TIMERS)):
    key, value = kv
    tag = f'tag{value % 3}'
    timers.set(Timestamp(100 + value % 3), dynamic_timer_tag=tag)
    timers.set(Timestamp(50), dynamic_timer_tag='cancelled')
    timers.clear(dynamic_timer_tag='cancelled')

  @on_timer(TIMERS)
  def fired(
      self,
      key=beam.DoFn.KeyParam,
      tag=beam.DoFn.DynamicTimerTagParam,
      ts=beam.DoFn.TimestampParam):
    yield key, tag, ts.micros // SEC


class LastWriteWinsTimer(beam.DoFn):
  """Each element re-sets the same timer; only the last setting fires."""
  TIMER = TimerSpec('timer', TimeDomain.WATERMARK)
  COUNT = CombiningValueStateSpec('count', combiners.CountCombineFn())

  def process(
      self, kv, timer=beam.DoFn.TimerParam(TIMER),
      count=beam.DoFn.StateParam(COUNT)):
    count.add(1)
    timer.set(Timestamp(1000 + count.read()))

  @on_timer(TIMER)
  def fired(self, key=beam.DoFn.KeyParam, ts=beam.DoFn.TimestampParam):
    yield key, ts.micros // SEC


class BagCountWithSideInput(beam.DoFn):
  BAG = BagStateSpec('bag', coders.VarIntCoder())

  def process(self, kv, labels, bag=beam.DoFn.StateParam(BAG)):
    bag.add(kv[1])
    yield kv[0], len(list(bag.read())), sorted(label for label, _ in labels)


class KeyAndSparkPartition(beam.DoFn):
  """Emits (key, the Spark partition this element's state lives in)."""
  SEEN = CombiningValueStateSpec('seen', combiners.CountCombineFn())

  def process(self, kv, seen=beam.DoFn.StateParam(SEEN)):
    from pyspark import TaskContext
    seen.add(1)
    yield kv[0], TaskContext.get().partitionId()


# -- tests ---------------------------------------------------------------------


def test_keys_spread_over_both_partitions_each_key_in_one(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(KeyAndSparkPartition())

  actual = collect.spark(build)
  partitions_of = {}
  for key, partition in actual:
    partitions_of.setdefault(key, set()).add(partition)
  assert sorted(partitions_of) == sorted(KEYS)
  assert all(len(ps) == 1 for ps in partitions_of.values()), partitions_of
  assert len({p for ps in partitions_of.values() for p in ps}) == 2


def test_bag_state_counts_per_key(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(BagCount())

  expected = sort_all(
      (f'k{i}', n) for i in range(NUM_KEYS) for n in range(1, count_of(i) + 1))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_bag_state_with_assert_that():
  with beam.Pipeline(options=options()) as p:
    out = keyed_input(p) | beam.ParDo(BagCount())
    assert_that(
        out,
        equal_to([(f'k{i}', n) for i in range(NUM_KEYS)
                  for n in range(1, count_of(i) + 1)]))


def test_bag_state_flushed_by_end_of_window_timer_global(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(BagFlushAtEndOfWindow())

  global_max = window.GlobalWindow().max_timestamp().micros
  actual, reference = collect.both(build)
  assert actual == reference
  assert [a[:4] for a in actual] == sort_all(
      (f'k{i}', list(range(count_of(i))), 'global', None)
      for i in range(NUM_KEYS))
  # Fired at the end of the global window (to the data channel's millis).
  assert {a[4] // 1000 for a in actual} == {global_max // 1000}


def test_bag_state_and_timer_per_key_and_window(collect):
  # State is per key and window: each fixed window flushes its own values.
  data = [(f'k{i}', v, v * 7 % 30) for i in range(NUM_KEYS) for v in range(6)]

  def build(p):
    return (
        p | beam.Create(data)
        | beam.Map(lambda e: window.TimestampedValue((e[0], e[1]), e[2]))
        | beam.WindowInto(window.FixedWindows(10))
        | beam.ParDo(BagFlushAtEndOfWindow()))

  groups = {}
  for k, v, ts in data:
    groups.setdefault((k, ts // 10 * 10), []).append(v)
  expected = sort_all((k, sorted(vs), start, start + 10)
                      for (k, start), vs in groups.items())
  actual, reference = collect.both(build)
  assert [a[:4] for a in reference] == expected
  assert [a[:4] for a in actual] == expected
  assert actual == reference


def test_combining_value_state(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(CombiningSum())

  expected = sort_all(
      [('count', f'k{i}', n) for i in range(NUM_KEYS)
       for n in range(1, count_of(i) + 1)] +
      [('total', f'k{i}', sum(range(count_of(i)))) for i in range(NUM_KEYS)])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_set_state(collect):
  def build(p):
    return (
        keyed_input(p, per_key=lambda i: 3 * (i % 4 + 1))
        | beam.MapTuple(lambda k, v: (k, f'v{v % 3}'))
        | beam.ParDo(DistinctWithSetState()))

  expected = sort_all((k, ['v0', 'v1', 'v2']) for k in KEYS)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_read_modify_write_state(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(ReadModifyWriteCounter())

  expected = sort_all(
      (f'k{i}', n) for i in range(NUM_KEYS) for n in range(1, count_of(i) + 1))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_ordered_list_state(collect):
  # Values v at time (v * 7) % 25 seconds, added in any order.
  def build(p):
    return (
        keyed_input(p, per_key=lambda i: 6)
        | beam.MapTuple(
            lambda k, v: window.TimestampedValue((k, v), (v * 7) % 25))
        | beam.ParDo(OrderedListByTimestamp()))

  everything = sorted(((v * 7) % 25, v) for v in range(6))
  middle = [(t, v) for t, v in everything if 10 <= t < 20]
  after_clear = [(t, v) for t, v in everything if t >= 10]
  expected = sort_all((k, everything, middle, after_clear) for k in KEYS)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_event_time_timer_fires_at_end_of_input(collect):
  def build(p):
    return (
        keyed_input(p)
        | beam.MapTuple(lambda k, v: window.TimestampedValue((k, v), v * 3))
        | beam.ParDo(EventTimeTimer()))

  expected = sort_all(
      (f'k{i}', list(range(count_of(i))), ((count_of(i) - 1) * 3 + 5) * SEC)
      for i in range(NUM_KEYS))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_processing_time_timer_fires_at_end_of_input(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(ProcessingTimeTimer())

  expected = sort_all(
      (f'k{i}', list(range(count_of(i)))) for i in range(NUM_KEYS))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_looping_timer_resets_itself_until_done(collect):
  def build(p):
    return keyed_input(p, per_key=lambda i: 1) | beam.ParDo(LoopingTimer(5))

  expected = sort_all(
      (k, n, n * 10) for k in KEYS for n in range(1, 6))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_dynamic_timer_family(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(DynamicTimers())

  expected = sort_all((f'k{i}', f'tag{t}', 100 + t) for i in range(NUM_KEYS)
                      for t in sorted({v % 3 for v in range(count_of(i))}))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_timer_set_many_times_fires_once_with_last_time(collect):
  def build(p):
    return keyed_input(p) | beam.ParDo(LastWriteWinsTimer())

  expected = sort_all(
      (f'k{i}', 1000 + count_of(i)) for i in range(NUM_KEYS))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_stateful_dofn_after_group_by_key_and_with_spark_parallelism(collect):
  # A stateful DoFn fed by a GroupByKey's output, with 3 shuffle partitions.
  def build(p):
    return (
        keyed_input(p)
        | beam.GroupByKey()
        | beam.MapTuple(lambda k, vs: (k, sum(vs)))
        | beam.ParDo(BagCount()))

  expected = sort_all((k, 1) for k in KEYS)
  assert collect.spark(build, spark_parallelism=3) == expected


def test_stateful_dofn_reading_a_flatten(collect):
  # Both flatten inputs' elements of a key reach the same state.
  def build(p):
    a = p | 'A' >> beam.Create([(k, 1) for k in KEYS])
    b = p | 'B' >> beam.Create([(k, 2) for k in KEYS[::2]])
    return (a, b) | beam.Flatten() | beam.ParDo(BagCount())

  expected = sort_all([(k, 1) for k in KEYS] + [(k, 2) for k in KEYS[::2]])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_stateful_dofn_with_side_input(collect):
  def build(p):
    # The side input holds (str, int) pairs like the main input: Beam 2.77's
    # ParDo._get_key_and_window_coder picks the "main" input from a set of
    # tag strings (hash-seed dependent), so it sometimes checks the side
    # input's type instead (a Beam quirk, not the runner's).
    labels = p | 'Labels' >> beam.Create([('x', 0), ('y', 1)])
    data = [(f'k{i}', v) for i in range(NUM_KEYS) for v in range(count_of(i))]
    return p | beam.Create(data) | beam.ParDo(
        BagCountWithSideInput(), beam.pvalue.AsList(labels))

  expected = sort_all((f'k{i}', n, ['x', 'y']) for i in range(NUM_KEYS)
                      for n in range(1, count_of(i) + 1))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_state_and_timers_in_sliding_windows(collect):
  # An element in two windows has separate state (and a timer) in each.
  def build(p):
    return (
        p | beam.Create([(f'k{i % 4}', i, i) for i in range(20)])
        | beam.Map(lambda e: window.TimestampedValue((e[0], e[1]), e[2]))
        | beam.WindowInto(window.SlidingWindows(10, 5))
        | beam.ParDo(BagFlushAtEndOfWindow()))

  groups = {}
  for i in range(20):
    last = i - i % 5
    for start in (last - 5, last):
      groups.setdefault((f'k{i % 4}', start), []).append(i)
  expected = sort_all((k, sorted(vs), start, start + 10)
                      for (k, start), vs in groups.items())
  actual, reference = collect.both(build)
  assert [a[:4] for a in actual] == expected
  assert actual == reference
