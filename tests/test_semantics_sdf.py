"""Splittable DoFns on local[2]: initial splits, self-checkpoints, file reads."""

import os

import apache_beam as beam
from apache_beam.io.restriction_trackers import OffsetRange
from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import window
from apache_beam.transforms.core import RestrictionProvider
from apache_beam.utils.timestamp import Duration

from conftest import Observe
from conftest import sort_all

SEC = 1_000_000


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


# -- user SDFs (module level: pickled by reference) ---------------------------


class OffsetRangeProvider(RestrictionProvider):
  """element (name, n) -> [0, n), initially split into chunks."""
  def __init__(self, chunk=None):
    self.chunk = chunk

  def initial_restriction(self, element):
    return OffsetRange(0, element[1])

  def create_tracker(self, restriction):
    return OffsetRestrictionTracker(restriction)

  def split(self, element, restriction):
    if self.chunk is None:
      yield restriction
    else:
      yield from restriction.split(self.chunk)

  def restriction_size(self, element, restriction):
    return restriction.size()


class EmitOffsets(beam.DoFn):
  """Emits (name, offset) for every claimed offset and, tagged 'starts',
  the start of every restriction it was given."""
  def process(
      self,
      element,
      tracker=beam.DoFn.RestrictionParam(OffsetRangeProvider(chunk=100))):
    name = element[0]
    restriction = tracker.current_restriction()
    yield beam.pvalue.TaggedOutput('starts', (name, restriction.start))
    position = restriction.start
    while tracker.try_claim(position):
      yield (name, position)
      position += 1


class CheckpointEvery(beam.DoFn):
  """Claims at most `step` offsets per call, then defers the remainder."""
  def __init__(self, step, delay_secs=None):
    self.step = step
    self.delay_secs = delay_secs

  def process(
      self, element, tracker=beam.DoFn.RestrictionParam(OffsetRangeProvider())):
    name = element[0]
    restriction = tracker.current_restriction()
    yield beam.pvalue.TaggedOutput('calls', (name, restriction.start))
    position = restriction.start
    for _ in range(self.step):
      if not tracker.try_claim(position):
        return
      yield (name, position)
      position += 1
    if self.delay_secs is None:
      tracker.defer_remainder()
    else:
      tracker.defer_remainder(Duration(seconds=self.delay_secs))


# -- tests ---------------------------------------------------------------------


def test_sdf_initial_splits_many_outputs(collect):
  sizes = {'small': 7, 'medium': 350, 'large': 1234, 'empty': 0}

  def build(p):
    outputs = (
        p | beam.Create(sorted(sizes.items()))
        | beam.ParDo(EmitOffsets()).with_outputs('starts', main='offsets'))
    offsets = outputs.offsets | 'TagOffsets' >> beam.Map(lambda x: ('o', x))
    starts = outputs.starts | 'TagStarts' >> beam.Map(lambda x: ('s', x))
    return (offsets, starts) | beam.Flatten()

  actual, reference = collect.both(build)
  offsets = [x for tag, x in actual if tag == 'o']
  assert offsets == sort_all(
      (name, i) for name, n in sizes.items() for i in range(n))
  assert reference == actual
  # Every initial split [100 k, ...) was processed as a restriction.
  starts = {x for tag, x in actual if tag == 's'}
  for name, n in sizes.items():
    for start in range(0, n, 100):
      if n - start >= 25:  # OffsetRange.split merges a small tail
        assert (name, start) in starts


def test_sdf_initial_splits_with_assert_that():
  with beam.Pipeline(options=options()) as p:
    out = (
        p | beam.Create([('a', 1000), ('b', 10)])
        | beam.ParDo(EmitOffsets()).with_outputs('starts', main='offsets'))
    assert_that(
        out.offsets,
        equal_to([('a', i) for i in range(1000)] + [('b', i)
                                                   for i in range(10)]))


def test_sdf_self_checkpoint_residuals_are_processed(collect):
  sizes = {'a': 20, 'b': 3, 'c': 11, 'd': 0}

  def build(p):
    outputs = (
        p | beam.Create(sorted(sizes.items()))
        | beam.ParDo(CheckpointEvery(3)).with_outputs('calls', main='offsets'))
    offsets = outputs.offsets | 'TagOffsets' >> beam.Map(lambda x: ('o', x))
    calls = outputs.calls | 'TagCalls' >> beam.Map(lambda x: ('c', x))
    return (offsets, calls) | beam.Flatten()

  actual, reference = collect.both(build)
  expected_offsets = sort_all(
      (name, i) for name, n in sizes.items() for i in range(n))
  expected_calls = sort_all(
      # one call per chunk of 3: the first (even for an empty restriction),
      # then one per non-empty residual
      (name, start) for name, n in sizes.items()
      for start in range(0, max(n, 1), 3))
  assert [x for tag, x in reference if tag == 'o'] == expected_offsets
  assert [x for tag, x in reference if tag == 'c'] == expected_calls
  assert [x for tag, x in actual if tag == 'o'] == expected_offsets
  assert [x for tag, x in actual if tag == 'c'] == expected_calls


def test_sdf_self_checkpoint_with_resume_delay(collect):
  def build(p):
    outputs = (
        p | beam.Create([('x', 6), ('y', 4)])
        | beam.ParDo(CheckpointEvery(2, delay_secs=0.05)).with_outputs(
            'calls', main='offsets'))
    return outputs.offsets

  assert collect.spark(build) == sort_all([('x', i) for i in range(6)] +
                                          [('y', i) for i in range(4)])


def test_sdf_self_checkpoint_after_reshuffle_many_elements(collect):
  # Elements spread over partitions first; every one checkpoints.
  def build(p):
    outputs = (
        p | beam.Create([(f'e{i}', i % 9) for i in range(60)])
        | beam.Reshuffle()
        | beam.ParDo(CheckpointEvery(4)).with_outputs(
            'calls', main='offsets'))
    return outputs.offsets

  assert collect.spark(build) == sort_all(
      (f'e{i}', j) for i in range(60) for j in range(i % 9))


def test_sdf_over_elements_in_sliding_windows(collect):
  # Each window of an element gets its own restriction and outputs.
  def build(p):
    outputs = (
        p | beam.Create([('a', 3, 4), ('b', 250, 11)])
        | beam.Map(lambda e: window.TimestampedValue((e[0], e[1]), e[2]))
        | beam.WindowInto(window.SlidingWindows(10, 5))
        | beam.ParDo(EmitOffsets()).with_outputs('starts', main='offsets'))
    return outputs.offsets | beam.ParDo(Observe())

  def windows(ts):
    last = ts - ts % 5
    return [('interval', s * SEC, (s + 10) * SEC) for s in (last - 5, last)]

  expected = sort_all(((name, i), ts * SEC, w)
                      for name, n, ts in [('a', 3, 4), ('b', 250, 11)]
                      for w in windows(ts) for i in range(n))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_sdf_self_checkpoint_in_sliding_windows(collect):
  def build(p):
    outputs = (
        p | beam.Create([('a', 7, 4), ('b', 5, 11)])
        | beam.Map(lambda e: window.TimestampedValue((e[0], e[1]), e[2]))
        | beam.WindowInto(window.SlidingWindows(10, 5))
        | beam.ParDo(CheckpointEvery(2)).with_outputs('calls', main='offsets'))
    return outputs.offsets | beam.ParDo(Observe())

  actual, reference = collect.both(build)
  assert actual == reference
  assert len(actual) == 2 * (7 + 5)


def _write_files(directory, contents):
  os.makedirs(directory, exist_ok=True)
  for name, text in contents.items():
    with open(os.path.join(directory, name), 'w') as f:
      f.write(text)


def test_read_from_text_multi_file_glob(collect, tmp_path):
  directory = str(tmp_path / 'input')
  contents = {
      f'part-{i}.txt': ''.join(f'file{i} line{j}\n' for j in range(100 * i))
      for i in range(5)
  }
  contents['no-newline.txt'] = 'first\nlast without newline'
  contents['ignored.csv'] = 'not matched by the glob\n'
  _write_files(directory, contents)
  pattern = os.path.join(directory, '*.txt')

  def build(p):
    return p | beam.io.ReadFromText(pattern)

  expected = sort_all(
      [f'file{i} line{j}' for i in range(5) for j in range(100 * i)] +
      ['first', 'last without newline'])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_read_from_text_glob_large_files_split_into_bundles(collect, tmp_path):
  directory = str(tmp_path / 'big')
  contents = {
      f'big-{i}.txt': ''.join(f'{i}:{j:07d}\n' for j in range(20000))
      for i in range(3)
  }
  _write_files(directory, contents)
  pattern = os.path.join(directory, 'big-*.txt')

  def build(p):
    return (
        p | beam.io.ReadFromText(pattern, min_bundle_size=1000)
        | beam.Map(lambda line: (line.split(':')[0], 1))
        | beam.CombinePerKey(sum))

  assert collect.spark(build) == [('0', 20000), ('1', 20000), ('2', 20000)]


def test_write_to_text_then_read_back(tmp_path):
  prefix = str(tmp_path / 'written' / 'out')
  with beam.Pipeline(options=options()) as p:
    _ = (
        p | beam.Create(range(300))
        | beam.Map(str)
        | beam.io.WriteToText(prefix, num_shards=3, shard_name_template='-SS'))
  names = sorted(os.listdir(os.path.dirname(prefix)))
  assert names == ['out-00', 'out-01', 'out-02']
  lines = []
  for name in names:
    with open(os.path.join(os.path.dirname(prefix), name)) as f:
      lines.extend(f.read().splitlines())
  assert sorted(lines, key=int) == [str(i) for i in range(300)]
