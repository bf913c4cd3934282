"""The fast path on the reduce side: stages reading a GroupByKey's output.

In this process (tests/fast_stages.py), each stage runs on the SDK harness
and on the fast path over the same grouped input, made as a task makes it
(the map side's records grouped by ``worker.shuffle.grouping``), and the
two must write the same bytes, element counts, user metrics and errors:
lifted combines' MergeAccumulators and ExtractOutputs, GroupByKey's
consumers, windows with their timestamp combiner and panes,
a large group whose values come in pages (iterated twice), a failing
user function. Then one job on local[2] with the fast path on and off
(CoGroupByKey's consumer among its stages).
"""

from __future__ import annotations

import functools
import zlib

import apache_beam as beam
import pytest
from apache_beam.metrics import Metrics
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.worker import elements
from beam_pyspark.worker import harnesses
from beam_pyspark.worker import shuffle
from beam_pyspark.worker.bundles import StageRunner
from beam_pyspark.worker.shuffle import grouping
from beam_pyspark.worker.shuffle import paging

from fast_stages import Planned
from fast_stages import first_line
from fast_stages import run_on_and_off

ATTEMPT = 9127  # the pages' owner, as a Spark task attempt would be


def reduce_stage(build, kvs, label='GroupByKey/Read', paged=False,
                 inline_bytes=grouping.INLINE_BYTES, stats=None):
  """The stage reading ``build``'s one GroupByKey whose stage name has
  ``label``, its input the grouping of ``kvs`` (values or WindowedValues)
  as a task groups the map side's records."""
  stage = Planned(build, label=label, inputs=[])
  assert stage.spec.grouped
  plan, runtime = stage.plan, stage.runtime
  (input_id, buffer_id), = stage.stage.inputs.items()
  spec = plan.groups[buffer_id]
  (producer, ) = [s for s in plan.stages if buffer_id in s.outputs.values()]
  (write, ) = [t for t, b in producer.outputs.items() if b == buffer_id]
  port = beam_fn_api_pb2.RemoteGrpcPort.FromString(
      beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
          producer.descriptor).transforms[write].spec.payload)
  chunks = list(elements.encode_stream(
      runtime.coder_impl(port.coder_id),
      [kv if isinstance(kv, WindowedValue) else
       window.GlobalWindows.windowed_value(kv) for kv in kvs]))
  coder_id = producer.output_coders[write]
  coder = runtime.coder(coder_id)
  compact = spec.default_windowing and shuffle.is_global_bytes_kv(
      runtime.coder(spec.safe_input_coder_id))
  if compact:
    records = shuffle.kv_value_records(chunks)
  else:
    records = shuffle.keyed_records(
        runtime.coder_impl(coder_id),
        coder.wrapped_value_coder.key_coder().get_impl(), chunks)
  packer = shuffle.PartitionPacker(1)
  packed = [c for _, c in packer.add(records)] + [
      c for _, c in packer.flush()]
  grouped = grouping.group_values(
      runtime, spec, packed, paged=paged, inline_bytes=inline_bytes,
      stats=stats, attempt=ATTEMPT, compact=compact)
  stage.inputs = [(input_id, chunk) for chunk in grouped]
  return stage


@pytest.fixture(autouse=True)
def _release_pages():
  yield
  paging.release(ATTEMPT)


def words(n=900):
  return [(f'w{i % 41}', i) for i in range(n)]


def test_lifted_combines_merge_and_extract_in_the_loop():
  stage = reduce_stage(
      lambda p: p | beam.Create(words()) | beam.CombinePerKey(sum)
      | beam.Map(lambda kv: (kv[1] % 5, kv[0])) | beam.GroupByKey(),
      [(f'w{i}', (i, )) for i in range(41)] * 3, label='Group/Read')
  kinds = [s.kind for s in stage.spec.steps]
  assert kinds[:2] == ['merge', 'extract'] and stage.spec.rest_stage is None
  records, counts, _, error = stage.compare()
  assert error is None and len(records) == 41
  # A mean: accumulators of (sum, count) pairs, output as floats.
  mean = reduce_stage(
      lambda p: p | beam.Create(words()) | beam.combiners.Mean.PerKey()
      | beam.Reshuffle(),
      [(f'w{i}', (i * 10, 3)) for i in range(41)] * 2, label='Group/Read')
  encoded, counts, _, error = mean.compare()
  assert error is None and len(encoded) == 41


class Summarize(beam.DoFn):
  """Iterates a group's values twice (Beam allows it) and counts them."""
  def __init__(self):
    self.groups = Metrics.counter('reduce', 'groups')
    self.sizes = Metrics.distribution('reduce', 'sizes')

  def process(self, kv):
    key, values = kv
    first = [(len(v), zlib.crc32(v)) for v in values]
    second = [(len(v), zlib.crc32(v)) for v in values]
    assert first == second, 'the second iteration differed'
    self.groups.inc()
    self.sizes.update(len(first))
    yield key, (len(first), sum(c for _, c in first))


def test_a_large_group_comes_in_pages_and_iterates_twice():
  values = [(('hot' if i % 4 else f'cold{i % 7}'),
             b'%6d' % i + bytes(2000)) for i in range(1200)]
  stats = {}
  stage = reduce_stage(
      lambda p: p | beam.Create([('k', b'v')]) | beam.GroupByKey()
      | beam.ParDo(Summarize()) | beam.Reshuffle(),
      values, paged=True, inline_bytes=100 << 10, stats=stats)
  assert stats['paged_groups'] == 1  # 'hot': 900 values, ~1.8 MB
  encoded, counts, user, error = stage.compare()
  assert error is None and len(encoded) == 8
  assert user[('ParDo(Summarize)', 'groups')] == 8
  # The loop's DoFn read the pages itself: no harness was made.
  assert stage.fell_back is None
  # A fallback at a group hands the rest over as it came: the large
  # group's page token, which the harness reads over the state API
  # ('cold3', the last key met, is the first group out of the grouper).
  handed = reduce_stage(
      lambda p: p | beam.Create([('k', b'v')]) | beam.GroupByKey()
      | beam.Map(tag_cold3)
      | beam.ParDo(Summarize()) | beam.Reshuffle(),
      values, paged=True, inline_bytes=100 << 10)
  encoded, _, user, error = handed.compare(fallback=True)
  assert handed.fell_back.kind == 'clean' and error is None
  assert len(encoded) == 7 and user[('ParDo(Summarize)', 'groups')] == 7


def tag_cold3(kv):
  """A tagged output the harness drops (the Map declares no such tag)."""
  return beam.pvalue.TaggedOutput('x', kv) if kv[0] == 'cold3' else kv


class Stamped(beam.DoFn):
  def process(self, x, ts=beam.DoFn.TimestampParam,
              w=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
    key, values = x
    yield key, (sorted(values), float(ts), w.start.micros,
                pane.timing, pane.is_first, pane.is_last)


@pytest.mark.parametrize('combiner,panes', [
    (window.TimestampCombiner.OUTPUT_AT_EOW, 1),
    (window.TimestampCombiner.OUTPUT_AT_EARLIEST, 1),
    # A trigger of its own: panes as Beam's batch trigger driver fires.
    (window.TimestampCombiner.OUTPUT_AT_EOW, 2)])
def test_windows_timestamps_and_panes_as_the_harness_gets_them(combiner,
                                                               panes):
  kvs = [WindowedValue((f'k{i % 3}', i), Timestamp(i), [window.IntervalWindow(
      i // 10 * 10, i // 10 * 10 + 10)]) for i in range(60)]
  trigger = {} if panes == 1 else dict(
      trigger=beam.trigger.Repeatedly(beam.trigger.AfterCount(2)),
      accumulation_mode=beam.trigger.AccumulationMode.ACCUMULATING)
  stage = reduce_stage(
      lambda p: p | beam.Create([('k', 1)])
      | beam.WindowInto(window.FixedWindows(10), timestamp_combiner=combiner,
                        **trigger)
      | beam.GroupByKey() | beam.ParDo(Stamped()) | beam.Reshuffle(),
      kvs)
  assert stage.spec.windowed
  encoded, counts, _, error = stage.compare()
  # 3 keys, 6 windows (the trigger's panes as Beam's batch driver fires
  # them); the bytes compared carry each pane's index and timing.
  assert error is None and len(encoded) >= 3 * 6


def fail_on_w7(kv):
  if kv[0] == 'w7':
    raise ValueError(f'failed on {kv[0]}')
  return kv


def test_a_failing_user_function_fails_as_on_the_harness():
  stage = reduce_stage(
      lambda p: p | beam.Create(words()) | beam.CombinePerKey(sum)
      | 'Fails' >> beam.Map(fail_on_w7) | beam.Reshuffle(),
      [(f'w{i}', (i, )) for i in range(41)], label='Group/Read')
  error = stage.compare(fallback=True)[3]
  assert error is not None and "[while running 'Fails']" in first_line(
      error) and 'failed on w7' in error


def test_an_empty_partition_makes_no_harness(monkeypatch):
  made = []
  monkeypatch.setattr(StageRunner, '_acquire_harness',
                      lambda self: made.append(1) or pytest.fail('harness'))
  stage = reduce_stage(
      lambda p: p | beam.Create(words()) | beam.CombinePerKey(sum)
      | beam.Reshuffle(), [], label='Group/Read')
  stage.inputs = []
  for fast in (True, False):
    encoded, counts, _, error = stage.run(fast=fast)
    assert error is None and encoded == [] and not made


def _pipeline(p, out):
  lines = p | beam.Create([f'w{i % 23} w{i % 7} x{i % 3}' for i in range(3000)])
  words_ = lines | beam.FlatMap(str.split)
  counts = words_ | beam.Map(lambda w: (w, 1)) | beam.CombinePerKey(sum)
  lengths = (words_ | 'Len' >> beam.Map(lambda w: (w, len(w)))
             | beam.GroupByKey() | beam.ParDo(SumValues()))
  total = words_ | beam.combiners.Count.Globally()
  joined = ({'counts': counts, 'lengths': lengths} | beam.CoGroupByKey()
            | beam.MapTuple(lambda k, g: f'{k} {list(g["counts"])} '
                            f'{list(g["lengths"])}'))
  _ = ((joined, total | beam.Map(lambda n: f'total {n}'))
       | beam.Flatten() | beam.io.WriteToText(out))


class SumValues(beam.DoFn):
  def __init__(self):
    self.seen = Metrics.counter('reduce', 'values')

  def process(self, kv):
    for _ in kv[1]:
      self.seen.inc()
    yield kv[0], sum(kv[1])


def test_a_job_with_the_fast_path_on_and_off(tmp_path, caplog):
  (on, off) = run_on_and_off(_pipeline, tmp_path)
  assert on[0] == off[0] and 'total 9000' in on[0] and len(on[0]) == 27
  assert on[1] == off[1] and on[2] == off[2]
  assert on[2]['MetricKey(step=ParDo(SumValues), metric=MetricName(' \
      'namespace=reduce, name=values), labels={})'] == 9000
  (note, ) = [m for m in on[3] if 'fused stages on the fast path' in m]
  # Every stage but the write's on the fast path, reduce sides included.
  done, of = [int(w) for w in note.split()[:3:2]]
  assert done == of, note
