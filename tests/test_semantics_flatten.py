"""Flatten on local[2]: unions, self-unions, Flatten feeding a GroupByKey."""

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to

from conftest import normalize
from conftest import sort_all


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


def test_flatten_union_of_several_pcollections(collect):
  def build(p):
    a = p | 'A' >> beam.Create(range(0, 50))
    b = p | 'B' >> beam.Create(range(100, 130))
    c = p | 'C' >> beam.Create(['x', 'y'])
    d = p | 'D' >> beam.Create([])
    e = b | 'Double' >> beam.Map(lambda x: x * 2)
    return (a, b, c, d, e) | beam.Flatten()

  expected = sort_all(
      list(range(0, 50)) + list(range(100, 130)) + ['x', 'y'] +
      [x * 2 for x in range(100, 130)])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_flatten_pcollection_with_itself(collect):
  def build(p):
    a = p | 'A' >> beam.Create([1, 2, 3, 4, 5])
    return (a, a) | beam.Flatten()

  expected = sort_all([1, 2, 3, 4, 5] * 2)
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_flatten_pcollection_with_itself_three_times_after_a_pardo(collect):
  def build(p):
    a = (
        p | 'A' >> beam.Create(range(20))
        | 'Square' >> beam.Map(lambda x: x * x))
    return (a, a, a) | beam.Flatten()

  expected = sort_all([x * x for x in range(20)] * 3)
  assert collect.spark(build) == expected


def test_flatten_feeds_groupbykey_that_also_reads_a_flatten_input(collect):
  # `a` is read by the Flatten and, beside it, by the GroupByKey's input:
  # GBK(Flatten(Flatten(a, b), a)).
  def build(p):
    a = p | 'A' >> beam.Create([('k1', 1), ('k2', 2), ('k3', 3)])
    b = p | 'B' >> beam.Create([('k1', 10), ('k4', 40)])
    f = (a, b) | 'Inner' >> beam.Flatten()
    return ((f, a) | 'Outer' >> beam.Flatten()
            | beam.GroupByKey()
            | beam.MapTuple(lambda k, vs: (k, sorted(vs))))

  expected = sort_all([
      ('k1', [1, 1, 10]),
      ('k2', [2, 2]),
      ('k3', [3, 3]),
      ('k4', [40]),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_flatten_and_a_direct_consumer_each_grouped(collect):
  # `a` is consumed by a Flatten (then grouped) and by its own GroupByKey.
  def build(p):
    a = p | 'A' >> beam.Create([('k', i) for i in range(5)])
    b = p | 'B' >> beam.Create([('k', 100), ('j', 7)])
    via_flatten = ((a, b) | beam.Flatten()
                   | 'GroupFlat' >> beam.GroupByKey()
                   | 'TagFlat' >> beam.MapTuple(
                       lambda k, vs: ('flat', k, sorted(vs))))
    direct = (
        a | 'GroupA' >> beam.GroupByKey()
        | 'TagA' >> beam.MapTuple(lambda k, vs: ('direct', k, sorted(vs))))
    return (via_flatten, direct) | 'Both' >> beam.Flatten()

  expected = sort_all([
      ('flat', 'k', [0, 1, 2, 3, 4, 100]),
      ('flat', 'j', [7]),
      ('direct', 'k', [0, 1, 2, 3, 4]),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_flatten_of_grouped_and_ungrouped_with_assert_that():
  with beam.Pipeline(options=options()) as p:
    a = p | 'A' >> beam.Create([('a', 1), ('b', 2), ('a', 3)])
    grouped = (
        a | beam.GroupByKey()
        | beam.MapTuple(lambda k, vs: (k, sum(vs))))
    both = (grouped, a) | beam.Flatten()
    assert_that(
        both | beam.Map(normalize),
        equal_to([('a', 4), ('b', 2), ('a', 1), ('b', 2), ('a', 3)]))
