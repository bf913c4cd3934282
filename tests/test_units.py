"""Unit tests of small pure pieces: timers, packing, hashing, metrics."""

import collections

from apache_beam.metrics import monitoring_infos as mi

from beam_pyspark.metrics import TaskMetrics
from beam_pyspark.metrics import merge_monitoring_infos
from beam_pyspark.spark.partitioning import pack_by_size
from beam_pyspark.spark.partitioning import stable_hash
from beam_pyspark.worker.timers import TimerTable

Timer = collections.namedtuple(
    'Timer', 'user_key dynamic_timer_tag windows clear_bit fire_timestamp')


def t(key, ts, tag='', clear=False):
  return Timer(key, tag, ['w'], clear, ts)


def test_timer_last_write_wins_and_clear_deletes():
  table = TimerTable()
  table.written('t', 'f', [t('a', 5), t('a', 3), t('b', 9), t('c', 1)])
  table.written('t', 'f', [t('c', 0, clear=True)])
  fired = table.take_round()
  assert [(x.user_key, x.fire_timestamp) for x in fired[('t', 'f')]] == [
      ('a', 3), ('b', 9)]
  assert not table


def test_timer_dynamic_tags_are_distinct():
  table = TimerTable()
  table.written('t', 'f', [t('a', 5, 'x'), t('a', 6, 'y')])
  assert len(table.take_round()[('t', 'f')]) == 2


def test_pack_by_size_balances_largest_first():
  sizes = [10, 9, 8, 1, 1, 1, 1, 1]
  bins = pack_by_size(sizes, 2)
  loads = sorted(sum(sizes[i] for i in b) for b in bins)
  # The best split of these sizes is 15 / 17.
  assert loads == [15, 17]
  assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
  assert pack_by_size([1.0], 4) == [[0]]


def test_stable_hash_is_not_pythons_hash():
  import zlib
  assert stable_hash(b'key') == zlib.crc32(b'key')


def _counter(v):
  return mi.int64_user_counter('ns', 'c', v, ptransform='T')


def test_merge_counters_distributions_gauges_string_sets_tries():
  infos = [
      _counter(2), _counter(3),
      mi.int64_user_distribution('ns', 'd', mi.DistributionData(5, 2, 1, 4), ptransform='T'),
      mi.int64_user_distribution('ns', 'd', mi.DistributionData(10, 1, 10, 10), ptransform='T'),
      mi.int64_user_gauge('ns', 'g', mi.GaugeData(7, 100), ptransform='T'),
      mi.int64_user_gauge('ns', 'g', mi.GaugeData(9, 50), ptransform='T'),
      mi.user_set_string('ns', 's', {'a', 'b'}, ptransform='T'),
      mi.user_set_string('ns', 's', {'b', 'c'}, ptransform='T'),
  ]
  merged = {mi.parse_namespace_and_name(m)[1]: m for m in merge_monitoring_infos(infos)}
  assert mi.extract_counter_value(merged['c']) == 5
  assert mi.extract_distribution(merged['d']) == (3, 15, 1, 10)
  assert mi.extract_gauge_value(merged['g'])[1] == 7
  assert mi.extract_string_set_value(merged['s']) == {'a', 'b', 'c'}


def test_committed_keeps_one_report_per_partition():
  m = TaskMetrics()
  c = _counter(4).SerializeToString()
  m.add([('s', 0, [c]), ('s', 0, [c]), ('s', 1, [c])])
  assert mi.extract_counter_value(m.committed()[0]) == 8
  assert mi.extract_counter_value(m.attempted()[0]) == 12
