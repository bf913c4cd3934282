"""The fast path's wider shapes against the harness, in this process.

Each test runs one planned stage on the SDK harness (StageRunner) and on
the fast path (FastStage) and compares the bytes of the shuffle records or
encoded elements, Beam's element counts, user metrics and errors
(tests/fast_stages.py): DoFns of the user's own with their bundle methods,
Beam's keyed and tuple transforms, Filter, Partition, timestamps and
windows carried, DoFn parameters, metrics, and errors from every method.
"""

from __future__ import annotations

import re

import apache_beam as beam
import pytest
from apache_beam.metrics import Metrics
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.worker import fastpath

from fast_stages import Planned
from fast_stages import first_line


class WordExtractingDoFn(beam.DoFn):
  """Beam's WordCount example's DoFn, as it is written there."""
  def process(self, element):
    return re.findall(r'[\w\']+', element, re.UNICODE)


class Buffering(beam.DoFn):
  """Bundle methods of its own: counts its bundles, holds its elements
  and outputs their sum at the bundle's end, in the global window."""
  def setup(self):
    self.bundles = Metrics.counter('life', 'bundles')

  def start_bundle(self):
    self.total = 0
    self.bundles.inc()
    Metrics.distribution('life', 'started').update(1)

  def process(self, x):
    self.total += x
    yield 'each', x

  def finish_bundle(self):
    yield WindowedValue(('sum', self.total), window.GlobalWindow().max_timestamp(),
                        [window.GlobalWindow()])


class Stamped(beam.DoFn):
  """Timestamps its outputs (as Beam's load tests' AssignTimestamps)."""
  def process(self, x):
    yield window.TimestampedValue(x, x * 10)


class Reads(beam.DoFn):
  """Reads the element's timestamp and window (DoFn parameters)."""
  def process(self, x, ts=beam.DoFn.TimestampParam,
              w=beam.DoFn.WindowParam):
    Metrics.counter('params', 'seen').inc()
    yield x[0], (x[1], ts.micros, str(w))


def numbers(n=600):
  return lambda p: p | beam.Impulse() | beam.FlatMap(lambda _: range(n))


def lines():
  return lambda p: p | beam.Impulse() | beam.FlatMap(
      lambda _: [f'w{i % 37} w{i % 11}, x{i % 5}' for i in range(800)])


def test_beams_wordcount_dofn_runs_in_the_loop():
  stage = Planned(lambda p: (
      lines()(p) | 'Split' >> beam.ParDo(WordExtractingDoFn())
      | beam.Map(lambda x: (x, 1)) | beam.CombinePerKey(sum)))
  assert stage.spec.rest_stage is None
  records, counts, _, error = stage.compare()
  assert error is None and len(records) == 37 + 5  # w0..w36, x0..x4
  assert sorted(counts.values())[-1] == 2400  # words


@pytest.mark.parametrize('shape', [
    'maptuple', 'flatmaptuple', 'filter', 'keys', 'values', 'kvswap',
    'withkeys'])
def test_keyed_and_tuple_transforms(shape):
  transform = {
      'maptuple': beam.MapTuple(lambda k, v: (v % 7, k)),
      'flatmaptuple': beam.FlatMapTuple(lambda k, v: [(k, v)] * (v % 3)),
      'filter': beam.Filter(lambda kv: kv[1] % 4 == 0),
      'keys': beam.Keys() | beam.Map(lambda k: (k, 1)),
      'values': beam.Values() | beam.Map(lambda v: (v % 5, v)),
      'kvswap': beam.KvSwap(),
      'withkeys': beam.Values() | beam.WithKeys(lambda v: v % 9),
  }[shape]
  stage = Planned(lambda p: (
      numbers()(p) | beam.Map(lambda x: (x % 13, x)) | transform
      | beam.GroupByKey()))
  assert stage.spec.rest_stage is None
  records, counts, _, _ = stage.compare()
  assert records and counts


def test_partition_routes_tagged_outputs_to_their_groupings():
  def build(p):
    parts = numbers()(p) | beam.Map(lambda x: (x % 10, x)) | beam.Partition(
        lambda kv, n: kv[1] % n, 3)
    for i, part in enumerate(parts):
      _ = part | f'Group{i}' >> beam.GroupByKey()

  stage = Planned(build)
  assert len(stage.spec.outputs) == 3
  outputs, counts, _, _ = stage.compare()
  assert sorted(len(v) for v in outputs.values()) == [200, 200, 200]


def test_bundle_methods_and_their_outputs_per_bundle():
  # Small bundles: both sides cut the 600 elements in the same places.
  stage = Planned(lambda p: (
      numbers()(p) | beam.Reshuffle() | 'Buffer' >> beam.ParDo(Buffering())
      | beam.CombinePerKey(sum)), label='Buffer', inputs=range(600),
                  bundle_bytes=256)
  records, counts, user, error = stage.compare()
  (bundles, ) = [v for (_, name), v in user.items() if name == 'bundles']
  # Each bundle's precombine emits the 'each' and the 'sum' key.
  assert error is None and bundles > 3 and len(records) == 2 * bundles


def test_a_dofn_wrapped_for_exception_handling_keeps_its_bundle_methods():
  # Beam's with_exception_handling wraps the DoFn in one that hands
  # start_bundle and the rest over by __getattribute__, its class defining
  # none: the loop once skipped them (Beam's DeadLettersTest.test_lifecycle
  # saw the state setup left), where the harness calls them.
  def build(p):
    good, _ = (numbers()(p) | beam.Reshuffle()
               | 'Buffer' >> beam.ParDo(Buffering()).with_exception_handling())
    return good | beam.CombinePerKey(sum)
  stage = Planned(build, label='Buffer', inputs=range(600), bundle_bytes=256)
  records, counts, user, error = stage.compare()
  (bundles, ) = [v for (_, name), v in user.items() if name == 'bundles']
  assert error is None and bundles > 3 and len(records) == 2 * bundles


def test_timestamped_outputs_are_carried():
  # Into a grouping (the timestamps do not count there) and into a
  # materialized output (they do: the encoded elements carry them).
  grouped = Planned(lambda p: (
      numbers()(p) | beam.ParDo(Stamped()) | beam.Map(lambda x: (x % 7, x))
      | beam.GroupByKey()))
  assert grouped.compare()[0]
  kept = Planned(lambda p: (
      numbers()(p) | beam.ParDo(Stamped())
      | beam.Map(lambda x: (x % 7, x)) | beam.ParDo(Reads())
      | beam.Reshuffle()))
  encoded, _, user, _ = kept.compare()
  assert len(encoded) == 600 and list(user.values()) == [600]


def test_windowed_pipeline_keeps_the_fast_path():
  # Timestamps, fixed windows, a combine keyed by window, and a grouping
  # of encoded windowed elements.
  combined = Planned(lambda p: (
      numbers()(p) | beam.ParDo(Stamped())
      | beam.WindowInto(window.FixedWindows(1000))
      | beam.Map(lambda x: (x % 3, x)) | beam.CombinePerKey(sum)))
  assert combined.spec.windowed and combined.spec.rest_stage is None
  records, counts, _, _ = combined.compare()
  assert len(records) == 3 * 6
  sliding = Planned(lambda p: (
      numbers()(p) | beam.ParDo(Stamped())
      | beam.WindowInto(window.SlidingWindows(2000, 1000))
      | beam.Map(lambda x: (x % 3, x)) | beam.ParDo(Reads())
      | beam.GroupByKey()))
  assert sliding.compare()[3] is None


@pytest.mark.parametrize('combine', [
    sum, beam.combiners.CountCombineFn(), beam.combiners.MeanCombineFn(),
    beam.combiners.TopCombineFn(2), max], ids=['sum', 'count', 'mean', 'top',
                                               'callable'])
@pytest.mark.parametrize('offset', [0, 300])
def test_fixed_windows_straight_into_a_precombine_equal_the_harness(
    combine, offset):
  """Map -> WindowInto(FixedWindows) -> CombinePerKey, a streaming count's
  shape: the table keyed by the window's start (no window per element),
  its output in Beam's IntervalWindows, byte for byte the harness's; over
  bundles (small ones) and negative timestamps."""
  inputs = [WindowedValue(i, Timestamp(micros=(i - 150) * 7919),
                          [window.GlobalWindow()]) for i in range(600)]
  stage = Planned(lambda p: (
      numbers()(p) | beam.Reshuffle()
      | 'Key' >> beam.Map(lambda x: (x % 4, x))
      | beam.WindowInto(window.FixedWindows(1, offset / 1000))
      | beam.CombinePerKey(combine)), label='WindowInto', inputs=inputs,
                  bundle_bytes=2000)
  records, counts, _, error = stage.compare()
  assert error is None and len(records) > 4 * 3
  (table, ) = [s for ss in stage.last.tree.sinks.values() for s in ss
               if s.kind == 'table']
  assert table.starts == (1_000_000, offset * 1000)


def test_windowed_input_elements():
  inputs = [WindowedValue(i, Timestamp(micros=i * 1000),
                          [window.IntervalWindow(i // 50 * 50, i // 50 * 50 + 50)])
            for i in range(300)]
  stage = Planned(lambda p: (
      numbers()(p) | beam.WindowInto(window.FixedWindows(50))
      | beam.Reshuffle() | 'Key' >> beam.Map(lambda x: (x % 4, x))
      | beam.ParDo(Reads()) | beam.GroupByKey()), label='Key', inputs=inputs)
  encoded, counts, _, error = stage.compare()
  assert error is None and len(encoded) == 300


def test_a_pardo_nothing_reads_runs_for_its_metrics():
  class Count(beam.DoFn):
    def process(self, x):
      Metrics.counter('end', 'seen').inc(x)
      yield x

  def build(p):
    values = numbers()(p) | beam.Map(lambda x: x * 2)
    _ = values | beam.ParDo(Count())
    _ = values | beam.Map(lambda x: (x, x)) | beam.GroupByKey()

  stage = Planned(build)
  _, counts, user, _ = stage.compare()
  assert list(user.values()) == [2 * sum(range(600))]


class Failing(beam.DoFn):
  def __init__(self, where):
    self.where = where

  def setup(self):
    if self.where == 'setup':
      raise ValueError('failed in setup')

  def start_bundle(self):
    if self.where == 'start_bundle':
      raise ValueError('failed in start_bundle')

  def process(self, x):
    if self.where == 'process' and x == 300:
      raise ValueError('failed in process')
    if self.where == 'output':
      return 'a str'
    return [(x % 5, x)]

  def finish_bundle(self):
    if self.where == 'finish_bundle':
      raise ValueError('failed in finish_bundle')
    if self.where == 'finish_output':
      return [('not', 'windowed')]


@pytest.mark.parametrize('where', [
    'setup', 'start_bundle', 'process', 'finish_bundle', 'output',
    'finish_output'])
def test_errors_in_each_method_are_beams_own(where):
  stage = Planned(lambda p: (
      numbers()(p) | 'Fails' >> beam.ParDo(Failing(where))
      | beam.GroupByKey()))
  error = stage.compare(fallback=True)[3]
  assert error is not None and "[while running 'Fails']" in first_line(error)


def test_metrics_from_every_step_and_bundle_method():
  class Measure(beam.DoFn):
    """As Beam's load tests' MeasureTime and CounterOperation."""
    def __init__(self, name):
      self.runtime = Metrics.distribution('load', f'{name}-runtime')
      self.counter = Metrics.counter('load', f'{name}-ops')

    def start_bundle(self):
      self.runtime.update(1)

    def finish_bundle(self):
      self.runtime.update(2)

    def process(self, x):
      self.counter.inc()
      yield x

  stage = Planned(lambda p: (
      numbers()(p) | 'Start' >> beam.ParDo(Measure('start'))
      | 'Step' >> beam.ParDo(Measure('step'))
      | beam.Map(lambda x: (x % 3, x)) | beam.CombinePerKey(sum)
      ), bundle_bytes=1 << 20)
  _, _, user, _ = stage.compare()
  assert user[('Start', 'start-ops')] == 600
  assert user[('Step', 'step-runtime')] == (2, )


def test_a_combine_fns_metrics_are_its_precombines_in_every_branch():
  # Beam's combiners_test (test_custormized_counters_in_combine_fn) with
  # its CombineFn, which the loop precombines as Beam's own (a user's
  # runs on the harness): the add_input updates of two combines fed by a
  # read were lost (the loop not yet metered: made in the commit, after
  # the element's check) or went to the step that ran before (metered:
  # the read's), not to each combine's Precombine as on the harness.
  from apache_beam.transforms.combiners_test import SortedConcatWithCounters

  def build(p):
    pairs = p | beam.Create(
        [(f'k{i % 3}', 'x' * (i % 4)) for i in range(50)], reshuffle=False)
    _ = pairs | beam.Values() | 'Global' >> beam.CombineGlobally(
        SortedConcatWithCounters())
    _ = pairs | 'PerKey' >> beam.CombinePerKey(SortedConcatWithCounters())

  def steps(user):  # a gauge's payload holds its time: its step only
    return {k: (v if k[1] != 'last_word_len' else None)
            for k, v in user.items()}

  stage = Planned(build, label='Create-Impulse')
  user = steps(stage.run(fast=False)[2])
  assert user[('Global/CombinePerKey/Precombine', 'word_counter')] == 50
  assert user[('PerKey/Precombine', 'word_counter')] == 50
  assert len([k for k in user if k[1] == 'word_counter']) == 2, user
  # The loop learning where updates go, then once it has learned.
  assert steps(stage.run(fast=True, release=False)[2]) == user
  assert stage.fell_back is None
  assert steps(stage.run(fast=True)[2]) == user


def test_setup_once_per_instance_and_teardown_at_release(tmp_path):
  log = tmp_path / 'life.txt'

  class Life(beam.DoFn):
    def setup(self):
      with open(log, 'a', encoding='utf-8') as f:
        f.write('setup\n')

    def teardown(self):
      with open(log, 'a', encoding='utf-8') as f:
        f.write('teardown\n')

    def process(self, x):
      yield x, x

  stage = Planned(lambda p: numbers()(p) | beam.ParDo(Life())
                  | beam.GroupByKey())
  for _ in range(3):  # three tasks in this Python worker
    assert stage.run(fast=True, release=False)[3] is None
  assert log.read_text().split() == ['setup']
  fastpath.harnesses.release_job(stage.job_id)
  assert log.read_text().split() == ['setup', 'teardown']


def tag_500(kv):
  return beam.pvalue.TaggedOutput('x', kv) if kv[1] == 500 else kv


def test_a_fallback_amid_bundle_methods_runs_the_partition_on_the_harness():
  # A tagged output of a single-output Map is the harness's to handle;
  # Buffering's bundle cannot be ended early, and nothing has left the
  # task: the partition runs again, whole, on the harness.
  stage = Planned(lambda p: (
      numbers()(p) | beam.ParDo(Buffering())
      | beam.Map(tag_500).with_output_types(tuple[str, int])
      | beam.CombinePerKey(sum)))
  records, counts, user, error = stage.compare(fallback=True)
  assert error is None and stage.fell_back.kind == 'unclean'
  assert stage.last.handover.whole_on_harness and len(records) == 2


def test_finish_bundle_outputs_keep_their_windows():
  class Windowed(beam.DoFn):
    """Outputs, at its bundle's end, one element per window it saw."""
    def start_bundle(self):
      self.seen = {}

    def process(self, x, w=beam.DoFn.WindowParam):
      self.seen[w] = self.seen.get(w, 0) + x
      return []

    def finish_bundle(self):
      for w, total in sorted(self.seen.items(), key=lambda i: i[0].start):
        yield WindowedValue(('total', total), w.max_timestamp(), [w])

  stage = Planned(lambda p: (
      numbers()(p) | beam.ParDo(Stamped())
      | beam.WindowInto(window.FixedWindows(1000))
      | beam.ParDo(Windowed()) | beam.GroupByKey()))
  encoded, counts, _, error = stage.compare()
  assert error is None and len(encoded) == 6


@pytest.mark.parametrize('ops', [
    [('ops', 1)] * 10, [('ops', -3)] * 4 + [('dist', 5)],
    [('ops', 2), ('other', 2), ('ops', 2)]])
def test_an_elements_counter_updates_settle_as_beams(ops):
  """ParDoTest's CounterOperation: one counter incremented many times per
  element (settled as one update), and mixed updates."""
  class Ops(beam.DoFn):
    def __init__(self):
      self.counters = {n: Metrics.counter('load', n) for n in ('ops', 'other')}
      self.dist = Metrics.distribution('load', 'dist')

    def process(self, x):
      for name, value in ops:
        if name == 'dist':
          self.dist.update(value)
        else:
          self.counters[name].inc(value)
      yield x

  stage = Planned(lambda p: numbers()(p) | 'Ops' >> beam.ParDo(Ops()),
                  bundle_bytes=1 << 20)
  _, _, user, _ = stage.compare()
  assert user[('Ops', 'ops')] == 600 * sum(v for n, v in ops if n == 'ops')
