"""Planning and validation: pure, no Spark."""

import sys

import apache_beam as beam
import pytest
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.testing.test_stream import TestStream as _TestStream
from apache_beam.transforms import environments
from apache_beam.transforms import userstate
from apache_beam.transforms import window

from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.planning import check_supported
from beam_pyspark.planning import plan_pipeline
from beam_pyspark.planning.plan import is_default_windowing


def _proto(build):
  p = beam.Pipeline()
  build(p)
  return p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default())


def test_planning_imports_no_spark():
  import subprocess
  code = ('import sys, beam_pyspark.planning; '
          'bad = sorted(m for m in sys.modules if m.startswith("pyspark")); '
          'assert not bad, bad')
  subprocess.run([sys.executable, '-c', code], check=True)


def test_wordcount_like_pipeline_fuses_around_the_shuffle():
  proto = _proto(lambda p: (
      p | beam.Create(['a b', 'b']) | beam.FlatMap(str.split)
      | beam.Map(lambda w: (w, 1)) | beam.CombinePerKey(sum)
      | beam.Map(print)))
  plan = plan_pipeline(proto)
  kinds = [s.kind for s in plan.stages]
  assert set(kinds) <= {'sdk', 'reshuffle'}
  # Exactly one GroupByKey buffer, written by one stage and read by another.
  assert len(plan.groups) == 1
  (group_buffer,) = plan.groups
  writers = [s for s in plan.stages if group_buffer in s.outputs.values()]
  readers = [s for s in plan.stages if group_buffer in s.inputs.values()]
  assert len(writers) == 1 and len(readers) == 1
  assert writers[0] is not readers[0]
  # Combiner lifting put a precombine before the shuffle.
  assert any('Precombine' in n for n in writers[0].transform_names)
  assert plan.groups[group_buffer].default_windowing


def test_create_uses_a_runner_reshuffle_stage():
  proto = _proto(lambda p: p | beam.Create(list(range(10))) | beam.Map(str))
  plan = plan_pipeline(proto)
  assert [s.kind for s in plan.stages].count('reshuffle') == 1


class _Stateful(beam.DoFn):
  BAG = userstate.BagStateSpec('bag', beam.coders.VarIntCoder())

  def process(self, kv, bag=beam.DoFn.StateParam(BAG)):
    bag.add(kv[1])
    yield kv


def test_stateful_dofn_starts_its_own_stage():
  proto = _proto(lambda p: (
      p | beam.Create([('a', 1)]) | beam.Map(lambda x: x)
      | beam.ParDo(_Stateful())))
  plan = plan_pipeline(proto)
  stateful = [s for s in plan.stages if s.stateful]
  assert len(stateful) == 1
  assert all(b.startswith(b'materialize:') for b in stateful[0].inputs.values())


def test_side_inputs_are_described_per_consumer():
  def build(p):
    side = p | 'side' >> beam.Create([1, 2])
    (p | beam.Create(['x']) | beam.Map(
        lambda x, s: (x, sum(s)), beam.pvalue.AsIter(side)))
  plan = plan_pipeline(_proto(build))
  specs = [si for s in plan.stages for si in s.side_inputs]
  assert len(specs) == 1
  assert specs[0].access_pattern == common_urns.side_inputs.ITERABLE.urn


def test_non_default_windowing_is_detected():
  def build(p):
    (p | beam.Create([('a', 1)]) | beam.WindowInto(beam.window.FixedWindows(10))
     | beam.GroupByKey())
  plan = plan_pipeline(_proto(build))
  (spec,) = plan.groups.values()
  assert not spec.default_windowing
  assert is_default_windowing(beam_runner_api_pb2.WindowingStrategy(
      window_fn=beam_runner_api_pb2.FunctionSpec(
          urn=common_urns.global_windows.urn),
      trigger=beam_runner_api_pb2.Trigger(
          default=beam_runner_api_pb2.Trigger.Default()),
      merge_status=beam_runner_api_pb2.MergeStatus.NON_MERGING,
      accumulation_mode=beam_runner_api_pb2.AccumulationMode.DISCARDING,
      output_time=beam_runner_api_pb2.OutputTime.END_OF_WINDOW))


def test_unsupported_items_are_all_listed_at_once():
  def build(p):
    (p | 'One' >> _TestStream().add_elements([1]) | beam.Map(lambda x: x))
    (p | 'Two' >> _TestStream().add_elements([2]) | 'M' >> beam.Map(str))
  proto = _proto(build)
  proto.requirements.append('beam:requirement:pardo:made_up:v1')
  docker = proto.components.environments['docker_env']
  docker.urn = common_urns.environments.DOCKER.urn
  with pytest.raises(UnsupportedPipelineError) as info:
    check_supported(proto)
  reasons = info.value.reasons
  assert any('2 TestStreams' in r for r in reasons)
  assert any('made_up' in r for r in reasons)
  assert any('docker_env' in r and 'embedded' in r for r in reasons)
  assert 'Change or remove' in str(info.value)


def test_supported_pipeline_passes_validation():
  check_supported(_proto(lambda p: p | beam.Create([1]) | beam.Map(str)))


# -- Pipelines of other SDKs: what the runner may know of their coders -------

_FOREIGN_CODER = 'beam:coder:genericobjectjs:v1'  # TypeScript's own coder


def _as_foreign_sdk(proto, merge_status=None, window_fn_urn=None):
  """``proto`` as another SDK would send it: its element coders are the
  SDK's own (a URN Python does not know), its environment lists only model
  coders in its capabilities (no state-backed iterables)."""
  for coder in proto.components.coders.values():
    if coder.spec.urn in (common_urns.coders.STRING_UTF8.urn,
                          common_urns.coders.VARINT.urn,
                          'beam:coder:pickled_python:v1',
                          'beam:coders:deterministic_pickled_python:v1'):
      coder.spec.urn = _FOREIGN_CODER
      coder.spec.payload = b''
  for env in proto.components.environments.values():
    del env.capabilities[:]
    env.capabilities.extend([common_urns.coders.BYTES.urn,
                             common_urns.coders.KV.urn])
  for ws in proto.components.windowing_strategies.values():
    if ws.window_fn.urn != common_urns.global_windows.urn:
      if merge_status is not None:
        ws.merge_status = merge_status
      if window_fn_urn is not None:
        ws.window_fn.urn = window_fn_urn
        ws.window_fn.payload = b'opaque'
  return proto


def _windowed_count(p, window_fn):
  (p | beam.Create([('a', 1)]) | beam.WindowInto(window_fn)
   | beam.GroupByKey() | beam.Map(str))


def test_a_foreign_sdks_coders_are_opaque_bytes_to_the_runner():
  proto = _as_foreign_sdk(_proto(
      lambda p: _windowed_count(p, beam.window.FixedWindows(10))))
  check_supported(proto)  # no coder is refused: they travel as bytes
  plan = plan_pipeline(proto)
  (spec,) = plan.groups.values()
  components = beam_runner_api_pb2.Components.FromString(plan.components)

  def urns(coder_id):
    coder = components.coders[coder_id]
    yield coder.spec.urn
    for c in coder.component_coder_ids:
      yield from urns(c)

  # The windowed grouping decodes keys and values with the runner-safe
  # coder (bytes in place of the SDK's coder), windows as interval windows
  # (the environment does not list them, so they travel as Beam's
  # timestamp-prefixed custom window; Python knows what is inside).
  assert _FOREIGN_CODER not in set(urns(spec.input_coder_id))
  assert common_urns.coders.INTERVAL_WINDOW.urn in set(urns(
      spec.input_coder_id))
  assert not spec.opaque_windows
  # No state-backed iterables for an environment that does not list them:
  # the grouped values reach its harness inline.
  readers = [s for s in plan.stages if spec.buffer_id in s.inputs.values()]
  assert readers and not any(s.state_backed_iterables for s in readers)
  for stage in readers:
    descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
        stage.descriptor)
    assert common_urns.coders.STATE_BACKED_ITERABLE.urn not in {
        c.spec.urn for c in descriptor.coders.values()}


def test_a_python_environment_gets_state_backed_groups():
  plan = plan_pipeline(_proto(
      lambda p: _windowed_count(p, beam.window.FixedWindows(10))))
  (spec,) = plan.groups.values()
  readers = [s for s in plan.stages if spec.buffer_id in s.inputs.values()]
  assert readers and all(s.state_backed_iterables for s in readers)


def test_custom_windows_decode_as_python_or_as_opaque_windows():
  class _Custom(beam.window.NonMergingWindowFn):
    def assign(self, context):
      return [beam.window.IntervalWindow(0, 10)]

    def get_window_coder(self):
      return beam.coders.coders.DeterministicFastPrimitivesCoder(
          beam.coders.PickleCoder(), 'custom window')

  # A Python pipeline's custom windows: decoded with Python's own coder.
  plan = plan_pipeline(_proto(lambda p: _windowed_count(p, _Custom())))
  (spec,) = plan.groups.values()
  assert spec.input_coder_id != spec.safe_input_coder_id
  assert not spec.opaque_windows
  # Another SDK's custom non-merging windows: opaque to the runner, which
  # groups them by their bytes and max timestamp.
  proto = _as_foreign_sdk(
      _proto(lambda p: _windowed_count(p, _Custom())),
      window_fn_urn='beam:window_fn:serialized_java:v1')
  for coder in proto.components.coders.values():
    if coder.spec.urn == 'beam:coder:pickled_python:v1':
      coder.spec.urn = 'beam:coders:javasdk:0.1'
  check_supported(proto)
  (spec,) = plan_pipeline(proto).groups.values()
  assert spec.input_coder_id == spec.safe_input_coder_id
  assert spec.opaque_windows


def test_another_sdks_merging_windows_are_refused_naming_the_grouping():
  proto = _as_foreign_sdk(
      _proto(lambda p: _windowed_count(p, beam.window.Sessions(10))),
      merge_status=beam_runner_api_pb2.MergeStatus.NEEDS_MERGE,
      window_fn_urn='beam:window_fn:serialized_java:v1')
  with pytest.raises(UnsupportedPipelineError) as info:
    check_supported(proto)
  assert any('serialized_java' in r and 'GroupByKey' in r
             for r in info.value.reasons)
  # Sessions, which Python knows, are merged by the runner whatever the SDK.
  check_supported(_as_foreign_sdk(
      _proto(lambda p: _windowed_count(p, beam.window.Sessions(10)))))


class _Timed(beam.DoFn):
  FLUSH = userstate.TimerSpec('flush', userstate.TimeDomain.WATERMARK)

  def process(self, kv, flush=beam.DoFn.TimerParam(FLUSH)):
    flush.set(10)
    yield kv

  @userstate.on_timer(FLUSH)
  def on_flush(self):
    yield 'flushed'


def test_a_stage_of_runner_transforms_runs_in_its_neighbours_sdk():
  # A GroupByKey before a stateful DoFn: fusion leaves the group's read and
  # write again as a stage of no environment.
  def build(p):
    (p | beam.Create([('a', 1)]) | beam.GroupByKey() | beam.ParDo(_Timed())
     | beam.Map(str))
  python_plan = plan_pipeline(_proto(build))
  assert [s.environment_id for s in python_plan.stages if s.kind == 'sdk'
          ].count('') == 1  # Python's: the embedded harness runs it
  proto = _as_foreign_sdk(_proto(build))
  for env in proto.components.environments.values():
    env.urn = common_urns.environments.EXTERNAL.urn
    env.capabilities.append(
        'beam:version:sdk_base:apache/beam_java17_sdk:2.62.0')
  plan = plan_pipeline(proto)
  envs = {s.environment_id for s in plan.stages if s.kind == 'sdk'}
  assert '' not in envs and len(envs) == 1


def test_javas_after_processing_time_without_a_delay_is_read_as_no_delay():
  from apache_beam.transforms import trigger as beam_trigger
  from beam_pyspark.planning.sdks import normalized_trigger
  from beam_pyspark.planning.sdks import trigger_problem
  # Java's AfterProcessingTime.pastFirstElementInPane(), repeated: no
  # timestamp transform at all (Python's decoder wants one).
  java = beam_runner_api_pb2.Trigger(
      repeat=beam_runner_api_pb2.Trigger.Repeat(
          subtrigger=beam_runner_api_pb2.Trigger(
              after_processing_time=beam_runner_api_pb2.Trigger.
              AfterProcessingTime())))
  assert trigger_problem(java) is None
  fn = beam_trigger.TriggerFn.from_runner_api(normalized_trigger(java), None)
  assert repr(fn) == repr(
      beam_trigger.Repeatedly(beam_trigger.AfterProcessingTime(0)))
  aligned = beam_runner_api_pb2.Trigger(
      after_processing_time=beam_runner_api_pb2.Trigger.AfterProcessingTime(
          timestamp_transforms=[beam_runner_api_pb2.TimestampTransform(
              align_to=beam_runner_api_pb2.TimestampTransform.AlignTo(
                  period=1000))]))
  assert 'alignment' in trigger_problem(aligned)
  # Refused at Prepare, naming the GroupByKey that would need it.
  proto = _proto(lambda p: _windowed_count(p, beam.window.FixedWindows(10)))
  for ws in proto.components.windowing_strategies.values():
    if ws.window_fn.urn != common_urns.global_windows.urn:
      ws.trigger.CopyFrom(aligned)
  with pytest.raises(UnsupportedPipelineError) as info:
    check_supported(proto)
  assert any('GroupByKey' in r and 'alignment' in r
             for r in info.value.reasons)


def _precombined(plan) -> bool:
  urn = common_urns.combine_components.COMBINE_PER_KEY_PRECOMBINE.urn
  return any(t.spec.urn == urn for s in plan.stages if s.descriptor
             for t in beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
                 s.descriptor).transforms.values())


@pytest.mark.parametrize('windowing, lifted', [
    ({}, True),
    ({'trigger': beam.transforms.trigger.Always()}, False),
    ({'trigger': beam.transforms.trigger.AfterWatermark(
        early=beam.transforms.trigger.AfterCount(2))}, False),
    ({'trigger': beam.transforms.trigger.Repeatedly(
        beam.transforms.trigger.AfterCount(1))}, False),
    ({'trigger': beam.transforms.trigger.Repeatedly(
        beam.transforms.trigger.AfterProcessingTime(5))}, True),
    ({'timestamp_combiner':
      beam.transforms.window.TimestampCombiner.OUTPUT_AT_EARLIEST}, False),
])
def test_a_streaming_combine_is_lifted_only_when_nothing_is_lost(
    windowing, lifted):
  if 'trigger' in windowing:
    windowing['accumulation_mode'] = (
        beam.transforms.trigger.AccumulationMode.DISCARDING)

  def build(p):
    _ = (p | beam.Create([('a', 1)])
         | beam.WindowInto(beam.transforms.window.FixedWindows(10),
                           **windowing)
         | beam.CombinePerKey(sum))
  assert _precombined(plan_pipeline(_proto(build), streaming=True)) == lifted


def test_a_batch_combine_is_lifted_as_beam_lifts_it():
  def build(p):
    _ = (p | beam.Create([('a', 1)])
         | beam.WindowInto(beam.transforms.window.FixedWindows(10),
                           trigger=beam.transforms.trigger.Always(),
                           accumulation_mode=beam.transforms.trigger.
                           AccumulationMode.DISCARDING)
         | beam.CombinePerKey(sum))
  assert _precombined(plan_pipeline(_proto(build)))


def test_a_global_combines_grouping_has_one_key_in_batch_only():
  def build(p):
    numbers = p | beam.Create([1, 2, 3])
    _ = numbers | 'Sum' >> beam.CombineGlobally(sum)
    _ = (numbers | 'Window' >> beam.WindowInto(window.FixedWindows(10))
         | 'Count' >> beam.combiners.Count.Globally().without_defaults())
    _ = numbers | beam.Map(lambda n: (n % 2, n)) | beam.CombinePerKey(sum)
    _ = numbers | beam.Map(lambda n: (None, n)) | beam.GroupByKey()

  proto = _proto(build)
  groups = plan_pipeline(proto).groups.values()
  one_key = sorted(g.transform_name for g in groups if g.one_key)
  assert len(groups) == 4 and len(one_key) == 2
  assert one_key[0].startswith('Count/') and one_key[1].startswith('Sum/')
  # A GroupByKey of keys the user made None is not known to have one key.
  streamed = plan_pipeline(proto, streaming=True).groups.values()
  assert streamed and not any(g.one_key for g in streamed)


def _reshuffle_of(proto):
  (found,) = [t for t in proto.components.transforms.values()
              if t.spec.urn == common_urns.composites.RESHUFFLE.urn]
  return found


def _with_sdk(proto, transform, image):
  """``transform``'s leaves in an environment of Beam's ``image``."""
  env = beam_runner_api_pb2.Environment(
      urn=common_urns.environments.DOCKER.urn,
      payload=beam_runner_api_pb2.DockerPayload(
          container_image=image).SerializeToString(),
      capabilities=[f'beam:version:sdk_base:{image}'])
  proto.components.environments['sdk_env'].CopyFrom(env)
  stack = list(transform.subtransforms)
  while stack:
    sub = proto.components.transforms[stack.pop()]
    if sub.environment_id:
      sub.environment_id = 'sdk_env'
    stack.extend(sub.subtransforms)


def test_only_javas_keyed_reshuffle_keeps_keys_together():
  """Java's Reshuffle.of carries the URN on a keyed GroupByKey expansion
  (its WriteFiles relies on a key's elements reaching one bundle);
  Python's and Go's on their random-key form."""
  from beam_pyspark.planning import reshuffles
  proto = _proto(lambda p: (
      p | beam.Create([('k', 1), ('j', 2)], reshuffle=False) | beam.Reshuffle()
      | beam.Map(print)))
  reshuffle = _reshuffle_of(proto)
  assert not reshuffles.keeps_keys(proto.components, reshuffle)
  _with_sdk(proto, reshuffle, 'apache/beam_go_sdk:2.62.0')
  assert not reshuffles.keeps_keys(proto.components, reshuffle)
  _with_sdk(proto, reshuffle, 'apache/beam_java17_sdk:2.62.0')
  assert reshuffles.keeps_keys(proto.components, reshuffle)
  # Not a KV: nothing to keep together, whatever the SDK.
  plain = _proto(lambda p: (
      p | beam.Create([1, 2], reshuffle=False) | beam.Reshuffle()
      | beam.Map(print)))
  plain_reshuffle = _reshuffle_of(plain)
  _with_sdk(plain, plain_reshuffle, 'apache/beam_java17_sdk:2.62.0')
  assert not reshuffles.keeps_keys(plain.components, plain_reshuffle)
