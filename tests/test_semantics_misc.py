"""Assorted pipeline shapes on local[2], each checked against the FnApiRunner
and by hand: CoGroupByKey, chained GroupByKeys, unusual keys, empty
PCollections, multi-output ParDos, combiners with side inputs, bundle
finalization."""

import os
import uuid

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pvalue import AsSingleton
from apache_beam.transforms import combiners

from conftest import sort_all


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


class SumPlusSide(beam.CombineFn):
  """sum(values) + side, the side input added once, at extraction."""
  def create_accumulator(self, *unused):
    return 0

  def add_input(self, acc, value, side):
    return acc + value

  def merge_accumulators(self, accumulators, *unused):
    return sum(accumulators)

  def extract_output(self, acc, side):
    return acc + side


class FinalizeToFile(beam.DoFn):
  """Registers a bundle finalizer that drops a file into `directory`."""
  def __init__(self, directory):
    self.directory = directory

  def process(self, x, finalizer=beam.DoFn.BundleFinalizerParam):
    path = os.path.join(self.directory, f'{x}-{uuid.uuid4().hex}')
    finalizer.register(lambda: open(path, 'w').close())
    yield x


def test_co_group_by_key(collect):
  def build(p):
    a = p | 'A' >> beam.Create([('x', 1), ('y', 2), ('x', 3)])
    b = p | 'B' >> beam.Create([('x', 'a'), ('z', 'b')])
    return ({'a': a, 'b': b} | beam.CoGroupByKey()
            | beam.MapTuple(lambda k, d: (k, sorted(d['a']), sorted(d['b']))))

  expected = [('x', [1, 3], ['a']), ('y', [2], []), ('z', [], ['b'])]
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_chain_of_group_by_keys(collect):
  def build(p):
    pc = p | beam.Create([(i % 64, i) for i in range(3000)])
    for j in range(4):
      pc = (pc | f'Group{j}' >> beam.GroupByKey()
            | f'Halve{j}' >> beam.MapTuple(lambda k, vs: (k // 2, sum(vs))))
    return pc

  # The last grouping sees keys (i % 64) // 8; its output keys are halved.
  sums = {}
  for i in range(3000):
    k = (i % 64) // 8
    sums[k] = sums.get(k, 0) + i
  expected = sort_all((k // 2, s) for k, s in sums.items())
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_group_and_state_with_unusual_keys(collect):
  data = [(None, 1), (b'x', 2), (('t', 1), 3), (None, 4), (('t', 1), 5),
          (-3, 6), ('', 7), (b'x', 8)]

  def build(p):
    return (
        p | beam.Create(data) | beam.GroupByKey()
        | beam.MapTuple(lambda k, vs: (repr(k), sorted(vs))))

  expected = sort_all([('None', [1, 4]), ("b'x'", [2, 8]),
                       ("('t', 1)", [3, 5]), ('-3', [6]), ("''", [7])])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_large_group_by_key(collect):
  def build(p):
    return (
        p | beam.Create(range(100000)) | beam.Map(lambda x: (x % 1000, x))
        | beam.GroupByKey()
        | beam.MapTuple(lambda k, vs: (k, len(list(vs)), sum(vs))))

  expected = [(k, 100, sum(range(k, 100000, 1000))) for k in range(1000)]
  assert collect.spark(build) == expected


def test_empty_pcollections_through_every_primitive(collect):
  def build(p):
    grouped = (
        p | 'E1' >> beam.Create([]) | beam.Map(lambda x: (x, x))
        | beam.GroupByKey())
    reshuffled = p | 'E2' >> beam.Create([]) | beam.Reshuffle()
    flattened = (
        (p | 'E3' >> beam.Create([]), p | 'E4' >> beam.Create([]))
        | 'FlattenEmpty' >> beam.Flatten())
    counted = p | 'E5' >> beam.Create([]) | combiners.Count.Globally()
    return (grouped, reshuffled, flattened, counted) | beam.Flatten()

  actual, reference = collect.both(build)
  assert reference == [0]
  assert actual == [0]


def test_multi_output_pardo_feeding_separate_groupings(collect):
  def split(x):
    yield beam.pvalue.TaggedOutput('even' if x % 2 == 0 else 'odd', (x % 3, x))
    yield x

  def build(p):
    outs = (
        p | beam.Create(range(20))
        | beam.FlatMap(split).with_outputs('even', 'odd', 'unused',
                                           main='main'))
    even = (
        outs.even | 'GroupEven' >> beam.GroupByKey()
        | 'TagEven' >> beam.MapTuple(lambda k, vs: ('e', k, sorted(vs))))
    odd = (
        outs.odd | 'GroupOdd' >> beam.GroupByKey()
        | 'TagOdd' >> beam.MapTuple(lambda k, vs: ('o', k, sorted(vs))))
    return (even, odd, outs.main | beam.Map(lambda x: ('m', x, []))) | (
        beam.Flatten())

  expected = sort_all(
      [('e', k, [x for x in range(0, 20, 2) if x % 3 == k]) for k in range(3)] +
      [('o', k, [x for x in range(1, 20, 2) if x % 3 == k]) for k in range(3)] +
      [('m', x, []) for x in range(20)])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_combine_with_side_input(collect):
  def build(p):
    side = p | 'Side' >> beam.Create([100])
    values = p | beam.Create([(i % 3, i) for i in range(30)])
    per_key = values | beam.CombinePerKey(SumPlusSide(), AsSingleton(side))
    total = (
        values | beam.Values()
        | beam.CombineGlobally(SumPlusSide(), AsSingleton(side))
        | beam.Map(lambda t: ('all', t)))
    return (per_key, total) | beam.Flatten()

  expected = sort_all(
      [(k, sum(range(k, 30, 3)) + 100) for k in range(3)] +
      [('all', sum(range(30)) + 100)])
  actual, reference = collect.both(build)
  assert sort_all(reference) == expected
  assert sort_all(actual) == expected


def test_bundle_finalization_callbacks_run(tmp_path):
  directory = str(tmp_path / 'finalized')
  os.makedirs(directory)
  with beam.Pipeline(options=options()) as p:
    _ = (
        p | beam.Create(range(10))
        | beam.Reshuffle()
        | beam.ParDo(FinalizeToFile(directory)))
  names = os.listdir(directory)
  assert sorted(int(n.split('-')[0]) for n in names) == list(range(10))
