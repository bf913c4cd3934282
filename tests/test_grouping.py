"""GroupByKey's own shuffle: records packed per partition, grouping within a
memory budget with sorted runs spilled to disk, and large groups handed to
the harness in pages over the state API."""

import collections
import os
import random
import zlib

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to

from beam_pyspark.worker.shuffle import paging
from beam_pyspark.worker import shuffle

OURS = ['--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]']


def _records(n_keys=50, n=5000, seed=7):
  rnd = random.Random(seed)
  return [(b'k%d' % rnd.randrange(n_keys), b'v%d' % i) for i in range(n)]


def _expected(records):
  groups = collections.defaultdict(list)
  for k, v in records:
    groups[k].append(v)
  return {k: sorted(v) for k, v in groups.items()}


def _grouped(grouper):
  out = {}
  for key, values in grouper.groups():
    assert key not in out, 'a key came out twice'
    out[key] = sorted(values)
  return out


def test_packed_records_round_trip_and_partition_by_key():
  records = _records()
  packer = shuffle.PartitionPacker(3, limit=4096)
  chunks = list(packer.add(records)) + list(packer.flush())
  assert len(chunks) > 3  # the limit cut chunks
  by_partition = collections.defaultdict(list)
  for p, chunk in chunks:
    by_partition[p].extend(shuffle.unpack_records([chunk]))
  assert sorted(r for rs in by_partition.values() for r in rs) == sorted(records)
  for p, rs in by_partition.items():
    assert all(zlib.crc32(k) % 3 == p for k, _ in rs)


def test_grouper_in_memory_does_not_touch_disk(tmp_path):
  records = _records()
  grouper = shuffle.ExternalGrouper(1 << 30, str(tmp_path / 'spill'))
  grouper.add_all(records)
  assert not grouper.spilled
  assert _grouped(grouper) == _expected(records)
  assert not (tmp_path / 'spill').exists()


def test_grouper_spills_sorted_runs_merges_them_and_removes_them(tmp_path):
  records = _records(n=20000)
  spill = tmp_path / 'spill'
  # About 40 runs: more than one merge's fan-in, so runs are merged in rounds.
  grouper = shuffle.ExternalGrouper(60 << 10, str(spill))
  grouper.add_all(records)
  assert grouper.runs_written > shuffle.MAX_MERGE_FANIN
  assert len(os.listdir(spill)) <= shuffle.MAX_MERGE_FANIN + 1
  assert _grouped(grouper) == _expected(records)
  assert os.listdir(spill) == []


def test_one_key_larger_than_the_budget_streams_from_disk(tmp_path):
  records = [(b'hot', b'x%07d' % i) for i in range(50000)] + [(b'cold', b'c')]
  grouper = shuffle.ExternalGrouper(256 << 10, str(tmp_path))
  grouper.add_all(records)
  seen = {}
  for key, values in grouper.groups():
    count = 0
    for count, _ in enumerate(values, 1):
      pass
    seen[key] = count
  assert seen == {b'hot': 50000, b'cold': 1}


def test_pages_are_served_in_order_and_rereadable(tmp_path):
  from apache_beam.coders import coders
  impl = coders.BytesCoder().get_impl()
  values = [os.urandom(1000) for _ in range(3000)]  # ~3 MB: several pages
  token = paging.write_pages(iter(values), impl, attempt=123,
                             directory=str(tmp_path))
  for _ in range(2):
    got, cont, pages = [], None, 0
    while True:
      data, cont = paging.read_page(token, cont)
      pages += 1
      from apache_beam.coders.coder_impl import create_InputStream
      stream = create_InputStream(data)
      while stream.size() > 0:
        got.append(impl.decode_from_stream(stream, True))
      if not cont:
        break
    assert got == values
    assert pages >= 3
  paging.release(123)
  assert os.listdir(tmp_path) == []
  with pytest.raises(KeyError, match='No paged values'):
    paging.read_page(token, None)


class _Values:
  """One hot key of ~12 MB (several pages past the 4 MB inline part) and a
  few small keys; every value is distinct."""
  def __init__(self, per_shard, size):
    self.per_shard = per_shard
    self.size = size

  def __call__(self, shard):
    rnd = random.Random(shard)
    for i in range(self.per_shard):
      yield 'hot', b'%6d%6d' % (shard, i) + rnd.randbytes(self.size - 12)
    yield 'cold-%d' % (shard % 3), b'%6d' % shard


def _summarize_twice(kv):
  """Iterates the grouped values twice, as a DoFn may: both must agree."""
  key, values = kv
  first = [(len(v), zlib.crc32(v)) for v in values]
  second = [(len(v), zlib.crc32(v)) for v in values]
  assert first == second, 'the second iteration differed'
  return key, len(first), sum(n for n, _ in first), sum(c for _, c in first)


def _expected_summaries(shards, per_shard, size):
  gen = _Values(per_shard, size)
  groups = collections.defaultdict(list)
  for shard in range(shards):
    for k, v in gen(shard):
      groups[k].append(v)
  return [(k, len(vs), sum(map(len, vs)), sum(zlib.crc32(v) for v in vs))
          for k, vs in groups.items()]


def _run_large_group(shards, per_shard, size, options):
  """Groups _Values and summarizes each group twice; asserts the output."""
  p = beam.Pipeline(options=PipelineOptions(OURS + options))
  out = (
      p
      | beam.Create(list(range(shards)))
      | beam.FlatMap(_Values(per_shard, size))
      | beam.GroupByKey()
      | beam.Map(_summarize_twice))
  assert_that(out, equal_to(_expected_summaries(shards, per_shard, size)))
  p.run().wait_until_finish()


def test_large_group_spills_and_reaches_the_dofn_in_pages(client_log):
  # Hot key: 3000 values, ~12 MB.
  _run_large_group(6, 500, 4096, ['--group_memory_mb=2'])
  messages = [m for _, m in client_log.seen]
  reports = [m for m in messages if "GroupByKey 'GroupByKey'" in m]
  assert any('reached the next stage in pages' in m and ' 1 group(s)' in m
             for m in reports), messages
  assert any('sorted run(s)' in m and ' 0 sorted' not in m for m in reports)


def test_large_group_as_side_input_stays_inline():
  """A side input is collected to the driver: its groups are never paged."""
  p = beam.Pipeline(options=PipelineOptions(OURS))
  groups = (
      p
      | 'Values' >> beam.Create([('k', b'%05d' % i + b'x' * 2000)
                                 for i in range(3000)])
      | beam.GroupByKey())
  out = (
      p
      | 'One' >> beam.Create([None])
      | beam.Map(lambda _, side: sorted(
          (k, len(list(vs))) for k, vs in side), beam.pvalue.AsList(groups)))
  assert_that(out, equal_to([[('k', 3000)]]))
  p.run().wait_until_finish()


def test_large_group_with_process_environment(client_log):
  """The pages reach a harness over the gRPC state API the same way."""
  import sys
  _run_large_group(4, 400, 4096, [
      '--environment_type=PROCESS',
      '--environment_config={"command": "%s -m '
      'apache_beam.runners.worker.sdk_worker_main"}' % sys.executable])
  assert any('reached the next stage in pages' in m and ' 1 group(s)' in m
             for _, m in client_log.seen), client_log.seen


def _plan_one_gbk():
  from beam_pyspark.planning.plan import plan_pipeline
  from beam_pyspark.worker.runtime import JobRuntime
  p = beam.Pipeline()
  _ = p | beam.Create([('a', 1)]) | beam.GroupByKey() | beam.Map(print)
  plan = plan_pipeline(p.to_runner_api())
  (spec,) = plan.groups.values()
  return JobRuntime('compact-test', plan.components), spec


def _decode_groups(runtime, spec, chunks):
  """Grouped output -> {key: [values]}, reading paged tails like a harness."""
  from apache_beam.coders import coders
  from apache_beam.coders.coder_impl import create_InputStream
  safe = runtime.coder(spec.safe_output_coder_id)
  key_coder, iterable_coder = safe.wrapped_value_coder.coders()

  def read_state(token, element_impl):
    cont = None
    while True:
      data, cont = paging.read_page(token, cont)
      stream = create_InputStream(data)
      while stream.size() > 0:
        yield element_impl.decode_from_stream(stream, True)
      if not cont:
        return

  reader = coders.WindowedValueCoder(
      coders.TupleCoder([key_coder, coders.StateBackedIterableCoder(
          iterable_coder.value_coder(), read_state=read_state)]),
      safe.window_coder).get_impl()
  out = {}
  for chunk in chunks:
    stream = create_InputStream(chunk)
    while stream.size() > 0:
      wv = reader.decode_from_stream(stream, True)
      # Encoded in milliseconds, as every runner's elements are.
      max_ts = beam.transforms.window.GlobalWindow().max_timestamp()
      assert wv.timestamp.micros // 1000 == max_ts.micros // 1000
      assert wv.pane_info.is_first and wv.pane_info.is_last
      key, values = wv.value
      out[key] = sorted(values)
  return out


def test_compact_records_group_like_decoded_elements():
  """Key and value bytes sliced from the elements (whatever their pane and
  timestamp) group exactly like whole decoded elements, inline and paged."""
  from apache_beam.utils import windowed_value
  from beam_pyspark.worker.shuffle.grouping import group_values
  runtime, spec = _plan_one_gbk()
  assert shuffle.is_global_bytes_kv(runtime.coder(spec.safe_input_coder_id))
  in_impl = runtime.coder_impl(spec.safe_input_coder_id)
  panes = [windowed_value.PANE_INFO_UNKNOWN,
           windowed_value.PaneInfo(False, False,
                                   windowed_value.PaneInfoTiming.LATE, 3, 2),
           windowed_value.PaneInfo(True, False,
                                   windowed_value.PaneInfoTiming.EARLY, 7, -1)]
  elements = []
  for i in range(3000):
    key = b'hot' if i % 2 else b'k%d' % (i % 7)
    elements.append(in_impl.encode_nested(beam.transforms.window.GlobalWindows
        .windowed_value((key, b'v%05d' % i + b'.' * (i % 50)),
                        timestamp=i, pane_info=panes[i % 3])))
  chunk = b''.join(elements)
  key_impl = runtime.coder(spec.safe_input_coder_id
                           ).wrapped_value_coder.key_coder().get_impl()
  whole = list(shuffle.keyed_records(in_impl, key_impl, [chunk]))
  compact = list(shuffle.kv_value_records([chunk]))
  assert [k for k, _ in whole] == [k for k, _ in compact]
  assert all(w.endswith(c) for (_, w), (_, c) in zip(whole, compact))

  def pack(records):
    packer = shuffle.PartitionPacker(1)
    return [c for _, c in list(packer.add(records)) + list(packer.flush())]

  expected = _decode_groups(runtime, spec, group_values(
      runtime, spec, pack(whole), paged=False))
  assert len(expected) == 8 and len(expected[b'hot']) == 1500
  for paged, inline in ((False, 1 << 20), (True, 1 << 20), (True, 20000)):
    stats = {}
    got = _decode_groups(runtime, spec, group_values(
        runtime, spec, pack(compact), paged=paged, inline_bytes=inline,
        stats=stats, attempt=77, compact=True))
    assert got == expected
    assert stats.get("paged_groups", 0) == (1 if inline == 20000 else 0)
  paging.release(77)



@pytest.mark.parametrize('fast', [True, False])
def test_a_global_combine_groups_in_one_reduce_partition(fast):
  """CombineGlobally's GroupByKey has the one key None: one reduce
  partition (planning.lifting.keyed_by_none_only), not one per core of
  which all but one are empty tasks; windowed, each window's result still
  comes out. A GroupByKey of keys that are None by the user's Map keeps
  them all (assert_that's own)."""
  from apache_beam.transforms import window
  p = beam.Pipeline(options=PipelineOptions(
      OURS + ['--spark_parallelism=2'] + ([] if fast else ['--no_fast_path'])))
  numbers = p | beam.Create(list(range(1, 2001)), reshuffle=True)
  total = numbers | 'Sum' >> beam.CombineGlobally(sum)
  windowed = (
      numbers
      | beam.Map(lambda n: window.TimestampedValue(n, n % 7))
      | beam.WindowInto(window.FixedWindows(1))
      | 'Count' >> beam.combiners.Count.Globally().without_defaults())
  assert_that(total, equal_to([2001000]), label='CheckSum')
  counts = [len([n for n in range(1, 2001) if n % 7 == w]) for w in range(7)]
  assert_that(windowed, equal_to(counts), label='CheckCounts')
  result = p.run()
  result.wait_until_finish()
  execution = result._execution  # pylint: disable=protected-access
  rdds = execution._engine._buffer_rdds  # pylint: disable=protected-access
  partitions = {g.transform_name.split('/')[0]: (
      g.one_key, rdds[b].getNumPartitions())
                for b, g in execution.plan.groups.items()}
  assert partitions == {'Sum': (True, 1), 'Count': (True, 1),
                        'CheckSum': (False, 2), 'CheckCounts': (False, 2)}
