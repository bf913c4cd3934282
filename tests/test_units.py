"""Unit tests of small pure pieces: timers, packing, hashing, metrics."""

import collections
import logging

import apache_beam as beam
import pytest
from apache_beam import coders
from apache_beam.io.restriction_trackers import OffsetRange
from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
from apache_beam.metrics import monitoring_infos as mi
from apache_beam.testing.synthetic_pipeline import SyntheticSource
from apache_beam.transforms import userstate
from apache_beam.transforms import window

from beam_pyspark.metrics import TaskMetrics
from beam_pyspark.metrics import merge_monitoring_infos
from beam_pyspark.planning import fastpath as fastpath_plan
from beam_pyspark.spark.partitioning import pack_by_size
from beam_pyspark.spark.partitioning import stable_hash
from beam_pyspark.streaming.timers import TimerTable
from beam_pyspark.worker.fastpath import chain

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


def test_a_distribution_not_in_the_models_encoding_is_dropped(caplog):
  good = mi.int64_user_distribution(
      'ns', 'd', mi.DistributionData(5, 2, 1, 4), ptransform='T')
  # As Beam's TypeScript SDK 2.49 sends one: an iterable of the values.
  odd = mi.int64_user_distribution(
      'ns', 'odd', mi.DistributionData(5, 2, 1, 4), ptransform='T')
  odd.payload = b'\x00\x00\x00\x04' + odd.payload
  merged = merge_monitoring_infos([good, odd, odd])
  assert [mi.parse_namespace_and_name(m)[1] for m in merged] == ['d']
  assert mi.extract_distribution(merged[0]) == (2, 5, 1, 4)
  assert sum('Dropping distribution' in r.getMessage()
             for r in caplog.records) == 1


def test_committed_keeps_one_report_per_partition():
  m = TaskMetrics()
  c = _counter(4).SerializeToString()
  m.add([('s', 0, [c]), ('s', 0, [c]), ('s', 1, [c])])
  assert mi.extract_counter_value(m.committed()[0]) == 8
  assert mi.extract_counter_value(m.attempted()[0]) == 12


def test_settings_from_job_options():
  import logging
  from beam_pyspark.options import RunnerOptions
  s = RunnerOptions.from_job_options({
      'beam:option:spark_parallelism:v1': '7',
      'beam:option:drain:v1': True,
      'beam:option:default_sdk_harness_log_level:v1': 'warning',
      'beam:option:sdk_harness_log_level_overrides:v1': '{"noisy": "ERROR"}',
  }, master='local[2]', conf={'a': 'b'})
  assert (s.master, s.conf, s.parallelism, s.drain) == (
      'local[2]', {'a': 'b'}, 7, True)
  assert s.log_level == logging.WARNING
  assert s.log_overrides == {'noisy': logging.ERROR}
  assert s.job_options['beam:option:spark_parallelism:v1'] == '7'
  defaults = RunnerOptions.from_job_options({})
  assert (defaults.drain, defaults.log_level, defaults.log_overrides) == (
      False, logging.INFO, None)


def test_parse_level_names_numbers_and_errors():
  import logging
  import pytest
  from beam_pyspark.options import parse_level
  assert parse_level('DEBUG') == logging.DEBUG
  assert parse_level('15') == 15
  assert parse_level(None) == logging.INFO
  with pytest.raises(ValueError, match='level name'):
    parse_level('LOUDEST')


def test_runner_options_reach_settings():
  from apache_beam.options.pipeline_options import PipelineOptions
  from beam_pyspark.options import RunnerOptions
  s = RunnerOptions.from_pipeline_options(PipelineOptions([
      '--drain', '--default_sdk_harness_log_level=ERROR',
      '--split_stragglers_after_secs=3']))
  assert s.drain is True
  assert s.log_level == 40
  assert s.job_options['beam:option:split_stragglers_after_secs:v1'] == 3.0


def test_log_capture_bounds_and_filters():
  import logging
  from beam_pyspark.worker.setup.logs import capture_logs
  with capture_logs(logging.INFO, limit_records=3) as captured:
    logging.getLogger('user.code').debug('dropped: below level')
    logging.getLogger('py4j.java_gateway').warning('dropped: spark plumbing')
    for i in range(5):
      logging.getLogger('user.code').info('line %d', i)
  entries = captured.entries()
  texts = [t for _, _, t in entries]
  assert texts[:3] == ['user.code: line 0', 'user.code: line 1',
                       'user.code: line 2']
  assert '2 more log records of this task were dropped' in texts[3]
  assert logging.getLogger().handlers.count(captured) == 0


def test_captured_logs_leave_out_plumbing_and_the_root_loggers_name():
  from beam_pyspark.worker.setup.logs import capture_logs
  with capture_logs(logging.INFO) as captured:
    logging.getLogger('apache_beam.runners.worker.statecache').info(
        'Creating state cache with size 0')
    logging.getLogger().info('USERLOG from the root logger')
    logging.getLogger('apache_beam.runners.worker.statecache').warning(
        'a warning still counts')
  texts = [t for _, _, t in captured.entries()]
  assert texts == ['USERLOG from the root logger',
                   'apache_beam.runners.worker.statecache: a warning still '
                   'counts']


def test_splittable_input_finds_the_sdf_read():
  import apache_beam as beam
  from apache_beam.portability.api import beam_fn_api_pb2
  from beam_pyspark.planning.plan import plan_pipeline
  from beam_pyspark.worker.endpoints import splittable_input
  from apache_beam.io.restriction_trackers import OffsetRange
  from apache_beam.io.restriction_trackers import OffsetRestrictionTracker

  class Provider(beam.transforms.core.RestrictionProvider):
    def initial_restriction(self, n):
      return OffsetRange(0, n)

    def create_tracker(self, r):
      return OffsetRestrictionTracker(r)

    def restriction_size(self, e, r):
      return r.size()

  class Sdf(beam.DoFn):
    def process(self, n, tracker=beam.DoFn.RestrictionParam(Provider())):
      yield n

  p = beam.Pipeline()
  _ = p | beam.Create([3]) | beam.ParDo(Sdf()) | beam.Map(lambda x: x)
  plan = plan_pipeline(p.to_runner_api())
  found = [
      splittable_input(
          beam_fn_api_pb2.ProcessBundleDescriptor.FromString(s.descriptor))
      for s in plan.stages if s.kind == 'sdk']
  assert sum(1 for f in found if f) == 1


def test_memory_failures_name_the_memory_caps():
  from beam_pyspark.spark.failures import memory_hint
  conf = {'spark.executor.pyspark.memory': '1g',
          'spark.python.worker.memory': '256m'}
  hint = memory_hint(
      'org.apache.spark.SparkException: Python worker exited unexpectedly '
      '(crashed)', conf)
  assert 'spark.executor.pyspark.memory=1g' in hint
  assert 'spark.python.worker.memory=256m' in hint
  assert 'Raise spark.executor.pyspark.memory' in hint
  assert memory_hint('ValueError: bad input', conf) == ''


def test_jvm_class_archive_is_written_once_then_used(tmp_path, monkeypatch):
  import os
  from beam_pyspark.spark import jvm
  monkeypatch.delenv(jvm.ENV_SWITCH, raising=False)
  first = jvm.java_options(str(tmp_path))
  assert '-XX:ArchiveClassesAtExit=' in first
  # A second process while the first's JVM has not written it: no archive
  # option at all, rather than two writers.
  assert jvm.java_options(str(tmp_path)) == ''
  partial = first.split('-XX:ArchiveClassesAtExit=')[1].split()[0]
  # The JVM wrote it and exited, and its writer (here: a pid that is gone).
  gone = partial.replace(f'.{os.getpid()}.', '.999999999.')
  with open(gone, 'wb') as f:
    f.write(bytes.fromhex('a8ab0bf0') + b'\0' * 100)
  old = os.stat(gone).st_mtime - jvm.SETTLE_SECS - 1
  os.utime(gone, (old, old))
  used = jvm.java_options(str(tmp_path))
  assert '-XX:SharedArchiveFile=' in used
  assert os.path.exists(used.split('-XX:SharedArchiveFile=')[1].split()[0])
  monkeypatch.setenv(jvm.ENV_SWITCH, '0')
  assert jvm.java_options(str(tmp_path)) == ''


def test_jvm_class_archive_ignores_a_file_that_is_not_one(tmp_path):
  import os
  from beam_pyspark.spark import jvm
  first = jvm.java_options(str(tmp_path))
  partial = first.split('-XX:ArchiveClassesAtExit=')[1].split()[0]
  gone = partial.replace(f'.{os.getpid()}.', '.999999999.')
  with open(gone, 'wb') as f:
    f.write(b'not an archive')
  old = os.stat(gone).st_mtime - jvm.SETTLE_SECS - 1
  os.utime(gone, (old, old))
  again = jvm.java_options(str(tmp_path))
  assert not os.path.exists(gone)
  assert '-XX:SharedArchiveFile=' not in again


def test_harness_kinds_cover_exactly_the_environments_validation_accepts():
  # Validation (planning, no worker imports) and the harness registry name
  # the same environment URNs.
  from beam_pyspark.planning.validate import SUPPORTED_ENVIRONMENTS
  from beam_pyspark.worker.harnesses import KINDS
  assert set(KINDS) == set(SUPPORTED_ENVIRONMENTS)


def test_unnamed_channel_splits_are_the_asked_inputs():
  """Beam's Java harness leaves ChannelSplit.transform_id empty; the
  runner asked one input, so the split is that input's (a Java unbounded
  read's checkpoint failed with KeyError '')."""
  from apache_beam.portability.api import beam_fn_api_pb2
  from beam_pyspark.worker.harnesses.base import name_channel_splits
  split = beam_fn_api_pb2.ProcessBundleSplitResponse(channel_splits=[
      beam_fn_api_pb2.ProcessBundleSplitResponse.ChannelSplit(
          last_primary_element=0, first_residual_element=1),
      beam_fn_api_pb2.ProcessBundleSplitResponse.ChannelSplit(
          transform_id='named', first_residual_element=3),
  ])
  named = name_channel_splits(split, 'read')
  assert [c.transform_id for c in named.channel_splits] == ['read', 'named']
  assert named.channel_splits[0].first_residual_element == 1


def _claims(tracker, steps):
  """Each step's result (or error) and the tracker's state after it."""
  from apache_beam.io.range_trackers import OffsetRangeTracker  # pylint: disable=import-outside-toplevel
  out = []
  for op, arg in steps:
    try:
      result = getattr(tracker, op)(arg)
    except (ValueError, TypeError) as exn:
      result = (type(exn).__name__, str(exn))
    out.append((op, arg, result, tracker.start_position(),
                tracker.stop_position(), tracker.last_record_start,
                tracker.last_attempted_record_start,
                tracker._offset_of_last_split_point,  # pylint: disable=protected-access
                tracker.split_points(), tracker.fraction_consumed()))
  assert isinstance(tracker, OffsetRangeTracker)
  return out


def test_one_reader_offset_tracker_claims_as_beams():
  """The lock-free try_claim of a split's tracker (worker.reads): the
  same results, errors and state as Beam's OffsetRangeTracker, claim by
  claim, with Beam's other methods in between."""
  from apache_beam.io.range_trackers import OffsetRangeTracker  # pylint: disable=import-outside-toplevel
  from beam_pyspark.worker.reads import OneReaderOffsetRangeTracker  # pylint: disable=import-outside-toplevel
  sequences = [
      [('try_claim', i) for i in range(3, 12)],  # past the stop: False
      [('try_claim', 5), ('try_claim', 5)],  # not above the last attempt
      [('try_claim', 5), ('try_claim', 4), ('try_claim', 6)],
      [('try_claim', 2)],  # before the start
      [('try_claim', 4), ('set_current_position', 7), ('try_claim', 6),
       ('try_claim', 8)],  # below the last record: Beam's error
      [('try_claim', 3), ('try_split', 6), ('try_claim', 5),
       ('try_claim', 6), ('try_claim', 7)],  # split while read: new stop
      [('try_claim', 12), ('try_claim', 13)],
      [('try_claim', None)],
      [('try_claim', 3), ('try_claim', 4.5), ('try_claim', 5)],
  ]
  for steps in sequences:
    beams = _claims(OffsetRangeTracker(3, 10), steps)
    ours = OffsetRangeTracker(3, 10)
    ours.__class__ = OneReaderOffsetRangeTracker
    assert _claims(ours, steps) == beams, steps


_SEEN_TRACKERS: list = []


class SeenSource(SyntheticSource):
  """Notes its tracker's type (module level: pickled by reference, so a
  read of an unpickled copy notes it here)."""
  def read(self, range_tracker):
    _SEEN_TRACKERS.append(type(range_tracker))
    return super().read(range_tracker)


def test_read_split_reads_a_synthetic_source_as_beam():
  """A SyntheticSource split read with the swapped tracker: Beam's
  records (its own read over its own tracker), and its tracker swapped;
  a source whose tracker is no plain OffsetRangeTracker keeps its own."""
  from apache_beam.io.range_trackers import OffsetRangeTracker  # pylint: disable=import-outside-toplevel
  from beam_pyspark.worker import reads  # pylint: disable=import-outside-toplevel
  seen = _SEEN_TRACKERS
  for extra, kind in (({}, reads.OneReaderOffsetRangeTracker),
                      ({'splitPointFrequencyRecords': 0}, None)):
    spec = dict({'numRecords': 50, 'keySizeBytes': 2, 'valueSizeBytes': 3,
                 'hotKeyFraction': 0.5, 'numHotKeys': 3}, **extra)
    source = SeenSource(spec)
    beams = list(source.read(source.get_range_tracker(7, 31)))
    seen.clear()
    got = list(reads.read_split(reads.encode_split(source, 7, 31)))
    assert got == beams and len(got) == 24
    if kind is None:
      assert seen[0] is not reads.OneReaderOffsetRangeTracker
      assert not issubclass(seen[0], OffsetRangeTracker)
    else:
      assert seen == [kind]


def test_a_job_server_port_on_localhost_is_its_own_on_ipv4():
  """gRPC binds 'localhost:P' on whichever of [::1] and 127.0.0.1 are
  free and returns P if one was: with 127.0.0.1:P another process's, a
  client of localhost reached that process (Beam's Go SDK timed out
  staging). The job server's ports are its own on 127.0.0.1 or fail."""
  import socket
  from concurrent import futures
  import grpc
  import pytest
  from beam_pyspark.jobservice.server import bind_port
  with socket.socket() as taken:
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(RuntimeError):
      bind_port(grpc.server(futures.ThreadPoolExecutor(1)), 'localhost', port)
  server = grpc.server(futures.ThreadPoolExecutor(1))
  free = bind_port(server, 'localhost', 0)
  with socket.socket() as probe:  # 127.0.0.1:free is the server's now
    with pytest.raises(OSError):
      probe.bind(('127.0.0.1', free))


class _Plain(beam.DoFn):
  def process(self, element, timestamp=beam.DoFn.TimestampParam):
    yield element, timestamp


class _Stateful(beam.DoFn):
  COUNT = userstate.ReadModifyWriteStateSpec('count', coders.VarIntCoder())

  def process(self, element, count=beam.DoFn.StateParam(COUNT)):
    yield element


class _Restricted(beam.DoFn, beam.transforms.core.RestrictionProvider):
  def process(self, element, tracker=beam.DoFn.RestrictionParam()):
    yield element

  def initial_restriction(self, element):
    return OffsetRange(0, 1)

  def create_tracker(self, restriction):
    return OffsetRestrictionTracker(restriction)

  def restriction_size(self, element, restriction):
    return 1


class _ArgsInStartBundle(beam.DoFn):
  def start_bundle(self, window=beam.DoFn.WindowParam):
    pass

  def process(self, element):
    yield element


def test_the_fast_paths_dofn_check_refuses_state_restrictions_and_bundle_params():
  """chain._pardo's own check (without Beam's whole DoFnSignature): a DoFn
  taking state, a timer or a restriction in process, or parameters in a
  bundle method, is refused even if a plan let it through; the element
  and its timestamp are taken."""
  def load(dofn):
    step = fastpath_plan.Step('t', 'T', fastpath_plan.PARDO, b'', 'in',
                              (('None', 'out'), ))
    return chain._pardo(step, dofn, [], {}, window.GlobalWindows())

  call = load(_Plain())
  assert call.params == [(0, 'timestamp')] and call.dofn is not None
  for dofn, reason in ((_Stateful(), 'stateful'),
                       (_Restricted(), 'splittable'),
                       (_ArgsInStartBundle(), 'takes parameters')):
    with pytest.raises(chain.NotEligible, match=reason):
      load(dofn)
