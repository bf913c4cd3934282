"""Combine on local[2]: per key and globally, with and without windowing."""

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import combiners
from apache_beam.transforms import window

from conftest import Observe
from conftest import sort_all

SEC = 1_000_000


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


class MeanFn(beam.CombineFn):
  """A user CombineFn (module level: pickled by reference)."""
  def create_accumulator(self):
    return (0, 0)

  def add_input(self, acc, value):
    return acc[0] + value, acc[1] + 1

  def merge_accumulators(self, accumulators):
    sums, counts = zip(*accumulators)
    return sum(sums), sum(counts)

  def extract_output(self, acc):
    return acc[0] / acc[1] if acc[1] else float('nan')


DATA = [(f'k{i % 13}', i) for i in range(1000)]


def hand_means(data):
  sums = {}
  for k, v in data:
    s, c = sums.get(k, (0, 0))
    sums[k] = (s + v, c + 1)
  return sort_all((k, s / c) for k, (s, c) in sums.items())


def test_combine_per_key_user_mean(collect):
  def build(p):
    return p | beam.Create(DATA) | beam.Reshuffle() | beam.CombinePerKey(
        MeanFn())

  actual, reference = collect.both(build)
  assert reference == hand_means(DATA)
  assert actual == hand_means(DATA)


def test_combine_per_key_builtin_mean_with_assert_that():
  with beam.Pipeline(options=options()) as p:
    out = p | beam.Create(DATA) | beam.CombinePerKey(combiners.MeanCombineFn())
    assert_that(out, equal_to(hand_means(DATA)))


def test_combine_globally_sum(collect):
  def build(p):
    return p | beam.Create(range(1, 1001)) | beam.Reshuffle() | (
        beam.CombineGlobally(sum))

  assert collect.spark(build) == [500500]


def test_combine_globally_sum_of_empty_input_gives_default(collect):
  def build(p):
    return p | beam.Create([]) | beam.CombineGlobally(sum)

  actual, reference = collect.both(build)
  assert reference == [0]
  assert actual == [0]


def test_combine_per_key_mean_fixed_windows(collect):
  events = [(f'k{i % 3}', i, i * 0.5) for i in range(120)]  # 0s .. 59.5s

  def build(p):
    return (
        p | beam.Create(events)
        | beam.Map(lambda e: window.TimestampedValue((e[0], e[1]), e[2]))
        | beam.WindowInto(window.FixedWindows(15))
        | beam.CombinePerKey(MeanFn())
        | beam.ParDo(Observe()))

  groups = {}
  for k, v, ts in events:
    start = int(ts // 15) * 15
    groups.setdefault((k, start), []).append(v)
  expected = sort_all(
      ((k, sum(vs) / len(vs)), (start + 15) * SEC - 1000,
       ('interval', start * SEC, (start + 15) * SEC))
      for (k, start), vs in groups.items())
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_combine_globally_sum_sliding_windows(collect):
  def build(p):
    return (
        p | beam.Create(range(40))
        | beam.Map(lambda x: window.TimestampedValue(x, x))
        | beam.WindowInto(window.SlidingWindows(10, 5))
        | beam.CombineGlobally(sum).without_defaults()
        | beam.ParDo(Observe()))

  expected = []
  for start in range(-5, 40, 5):
    values = [x for x in range(40) if start <= x < start + 10]
    expected.append((sum(values), (start + 10) * SEC - 1000,
                     ('interval', start * SEC, (start + 10) * SEC)))
  expected = sort_all(expected)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_combine_per_key_sessions(collect):
  def build(p):
    return (
        p | beam.Create([('a', 1, 1), ('a', 2, 3), ('a', 10, 30), ('b', 5, 2)])
        | beam.Map(lambda e: window.TimestampedValue((e[0], e[1]), e[2]))
        | beam.WindowInto(window.Sessions(4))
        | beam.CombinePerKey(sum)
        | beam.ParDo(Observe()))

  expected = sort_all([
      (('a', 3), 7 * SEC - 1000, ('interval', 1 * SEC, 7 * SEC)),
      (('a', 10), 34 * SEC - 1000, ('interval', 30 * SEC, 34 * SEC)),
      (('b', 5), 6 * SEC - 1000, ('interval', 2 * SEC, 6 * SEC)),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected
