"""Fuse a Runner API pipeline into stages and describe what each needs.

The fusion itself is Beam's: an ordered list of pure phases from
``fn_api_runner.translations`` (the same ones the FnApiRunner uses), plus
``annotate_stateful_dofns_as_roots`` so that a stateful DoFn always starts a
stage whose input we can partition by key.  What this module adds is a
plain-data description of every stage (its bundle descriptor, where its
inputs come from and its outputs go, side inputs, timers, groupings), which
the Spark translation consumes without looking at Beam's Stage objects.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.portability.api import endpoints_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr
from apache_beam.runners.worker import bundle_processor
from apache_beam.utils import proto_utils

from beam_pyspark.planning import lifting
from beam_pyspark.planning import reads
from beam_pyspark.planning import reshuffles
from beam_pyspark.planning.normalize import normalized
from beam_pyspark.planning.sdks import accepts_state_backed_iterables
from beam_pyspark.planning.sdks import closes_windows_at_end
from beam_pyspark.planning.sdks import grouping_coders
from beam_pyspark.planning.sdks import adopt_environments
from beam_pyspark.planning.sdks import fires_per_element
from beam_pyspark.planning.sdks import teststream_elements_nested

DATA_INPUT_URN = bundle_processor.DATA_INPUT_URN
DATA_OUTPUT_URN = bundle_processor.DATA_OUTPUT_URN
IMPULSE_BUFFER = tr.IMPULSE_BUFFER
RESHUFFLE_URN = common_urns.composites.RESHUFFLE.urn
TEST_STREAM_URN = common_urns.primitives.TEST_STREAM.urn

# Transforms that Spark executes itself rather than the SDK harness.
# Declaring Reshuffle here gives a native repartition, and makes expand_sdf
# put a reshuffle between splitting restrictions and processing them, which
# is where we spread SDF work over partitions by size.
KNOWN_RUNNER_URNS = frozenset([
    common_urns.primitives.FLATTEN.urn,
    common_urns.primitives.GROUP_BY_KEY.urn,
    RESHUFFLE_URN,
    reads.SPLIT_URN,  # a bounded read's source, split on the driver
    TEST_STREAM_URN,  # replayed by the streaming engine's driver
])

# The order matters; each phase is (stages, context) -> stages.
PHASES = (
    reads.native_bounded_reads,  # first: it rewrites leaf stages
    tr.annotate_downstream_side_inputs,
    tr.annotate_stateful_dofns_as_roots,
    tr.fix_side_input_pcoll_coders,
    tr.pack_combiners,
    tr.lift_combiners,
    tr.expand_sdf,
    tr.expand_gbk,
    tr.sink_flattens,
    tr.greedily_fuse,
    tr.read_to_impulse,
    tr.impulse_to_input,
    tr.sort_stages,
    tr.add_impulse_to_dangling_transforms,
    tr.setup_timer_mapping,
    tr.populate_data_channel_coders,
)

# The in-memory data channel ignores endpoints, but the SDK harness only
# builds its timer map when a timer endpoint is set (as FnApiRunner does).
PLACEHOLDER_ENDPOINT = 'embedded'

_SPLIT_URNS = frozenset([
    common_urns.sdf_components.SPLIT_AND_SIZE_RESTRICTIONS.urn,
    common_urns.sdf_components.TRUNCATE_SIZED_RESTRICTION.urn,
])
SDF_CONSUMER_URNS = frozenset([
    common_urns.sdf_components.PROCESS_SIZED_ELEMENTS_AND_RESTRICTIONS.urn,
    common_urns.sdf_components.TRUNCATE_SIZED_RESTRICTION.urn,
])


@dataclasses.dataclass(frozen=True)
class SideInputSpec:
  transform_id: str
  tag: str
  buffer_id: bytes
  access_pattern: str
  coder_id: str  # the runner-safe windowed coder of the side input buffer


@dataclasses.dataclass(frozen=True)
class TimerSpec:
  transform_id: str
  family_id: str
  coder_id: str  # runner-safe timer coder
  time_domain: int


@dataclasses.dataclass(frozen=True)
class GroupSpec:
  """How to group one GroupByKey's buffer on the reduce side."""
  buffer_id: bytes
  transform_name: str
  # Runner-safe coders: keys and values stay opaque bytes where possible.
  safe_input_coder_id: str
  safe_output_coder_id: str
  # What a windowing other than the default decodes with: the runner-safe
  # coders' elements and the SDK's windows where Python knows their coder,
  # else opaque windows (planning.sdks.grouping_coders).
  input_coder_id: str
  output_coder_id: str
  windowing_strategy_id: str
  default_windowing: bool
  opaque_windows: bool = False
  final_panes: bool = False  # sdks.closes_windows_at_end, shuffle.panes
  fires_per_element: bool = False  # sdks.fires_per_element
  one_key: bool = False  # batch: lifting.keyed_by_none_only


@dataclasses.dataclass
class StagePlan:
  name: str
  # 'sdk': run bundles in the SDK harness; 'reshuffle': Spark repartitions;
  # 'read': the runner splits a bounded source (planning.reads);
  # 'teststream': the streaming engine replays a TestStream's events.
  kind: str
  inputs: dict[str, bytes]  # DATA_INPUT transform id -> buffer id
  outputs: dict[str, bytes]  # DATA_OUTPUT transform id -> buffer id
  # Runner-safe data channel coder per DATA_INPUT / DATA_OUTPUT transform.
  input_coders: dict[str, str]
  output_coders: dict[str, str]
  descriptor: bytes = b''  # serialized ProcessBundleDescriptor
  side_inputs: list[SideInputSpec] = dataclasses.field(default_factory=list)
  timers: list[TimerSpec] = dataclasses.field(default_factory=list)
  stateful: bool = False
  # For reshuffle stages fed by expand_sdf: elements are sized restrictions.
  sized: bool = False
  # For reshuffle stages: a key's elements stay in one partition (Java's
  # keyed Reshuffle.of, sdks.reshuffle_keeps_keys); else dealt evenly.
  keeps_keys: bool = False
  transform_names: list[str] = dataclasses.field(default_factory=list)
  # The environment whose harness runs the stage ('' for none).
  environment_id: str = ''
  # Whether that environment decodes state-backed iterables (it lists the
  # coder in its capabilities): only then may a grouping send a large
  # group's values in pages over the state API; else every value inline.
  state_backed_iterables: bool = False
  # 'read' stages: the ReadPayload of the bounded source to split;
  # 'teststream' stages: the TestStreamPayload.
  read_payload: bytes = b''
  # 'teststream' stages: DATA_OUTPUT transform id -> the TestStream's tag,
  # and -> the SDK's data channel coder its elements are encoded with.
  output_tags: dict[str, str] = dataclasses.field(default_factory=dict)
  element_coders: dict[str, str] = dataclasses.field(default_factory=dict)
  # 'teststream' stages: whether the SDK encoded the elements in the nested
  # context (planning.sdks.teststream_elements_nested).
  nested_elements: bool = False

  @property
  def descriptor_id(self) -> str:
    return self.name


@dataclasses.dataclass
class ExecutionPlan:
  components: bytes  # serialized beam_runner_api_pb2.Components
  stages: list[StagePlan]
  groups: dict[bytes, GroupSpec]

  def producers(self) -> dict[bytes, list[StagePlan]]:
    result: dict[bytes, list[StagePlan]] = {}
    for stage in self.stages:
      for buffer_id in stage.outputs.values():
        result.setdefault(buffer_id, []).append(stage)
    return result

  def consumers(self) -> dict[bytes, list[StagePlan]]:
    """Stages reading each buffer, as main input or as a side input."""
    result: dict[bytes, list[StagePlan]] = {}
    for stage in self.stages:
      seen = set()
      for buffer_id in list(stage.inputs.values()) + [
          si.buffer_id for si in stage.side_inputs]:
        if buffer_id not in seen:
          seen.add(buffer_id)
          result.setdefault(buffer_id, []).append(stage)
    return result


def fuse(pipeline_proto: beam_runner_api_pb2.Pipeline, drain: bool = False,
         streaming: bool = False):
  """Runs Beam's fusion phases; returns (TransformContext, [Stage]).

  ``drain`` expands splittable DoFns with their truncate step, as Beam does
  for a draining job; ``streaming`` chooses a streaming job's phases.
  """
  pipeline_proto = normalized(pipeline_proto)
  return tr.create_and_optimize_stages(
      pipeline_proto,
      phases=lifting.streaming_phases(PHASES) if streaming else PHASES,
      known_runner_urns=KNOWN_RUNNER_URNS,
      is_drain=drain)


def plan_pipeline(
    pipeline_proto: beam_runner_api_pb2.Pipeline,
    drain: bool = False, streaming: bool = False) -> ExecutionPlan:
  context, stages = fuse(pipeline_proto, drain, streaming)
  components = context.components
  safe = context.safe_coders
  channel = context.data_channel_coders

  def safe_coder(coder_id: str) -> str:
    return safe.get(coder_id, coder_id)

  all_transforms = [t for s in stages for t in s.transforms]
  consumers_by_pcoll: dict[str, list] = {}
  producers_by_pcoll: dict[str, object] = {}
  for t in all_transforms:
    for pcoll in t.inputs.values():
      consumers_by_pcoll.setdefault(pcoll, []).append(t)
    if t.spec.urn != DATA_INPUT_URN:  # a fused stage's read of a buffer
      for pcoll in t.outputs.values():
        producers_by_pcoll[pcoll] = t

  stage_plans = []
  groups: dict[bytes, GroupSpec] = {}
  for stage in stages:
    paging = accepts_state_backed_iterables(components, stage.environment)
    inputs, outputs, input_coders, output_coders = {}, {}, {}, {}
    transforms = {}
    reshuffle = None
    input_pcolls = {}
    for t in stage.transforms:
      t = copy.deepcopy(t)
      if t.spec.urn == DATA_INPUT_URN:
        pcoll = tr.only_element(t.outputs.values())
        input_pcolls[t.unique_name] = pcoll
        inputs[t.unique_name] = t.spec.payload
        input_coders[t.unique_name] = safe_coder(channel[pcoll])
        port_coder = channel[pcoll]
        if (paging and t.spec.payload != IMPULSE_BUFFER and
            tr.split_buffer_id(t.spec.payload)[0] == 'group'):
          # Grouped values may come as a state-backed iterable: the first
          # values inline, the rest in pages over the state API
          # (worker.shuffle.paging).  The harness decodes both forms with it.
          port_coder = context.with_state_iterables(port_coder)
        t.spec.payload = _grpc_port(port_coder)
      elif t.spec.urn == DATA_OUTPUT_URN:
        pcoll = tr.only_element(t.inputs.values())
        outputs[t.unique_name] = t.spec.payload
        output_coders[t.unique_name] = safe_coder(channel[pcoll])
        t.spec.payload = _grpc_port(channel[pcoll])
      elif t.spec.urn == RESHUFFLE_URN:
        reshuffle = t
      transforms[t.unique_name] = t

    for buffer_id in list(outputs.values()):
      kind, name = tr.split_buffer_id(buffer_id)
      if kind == 'group' and buffer_id not in groups:
        groups[buffer_id] = _group_spec(
            buffer_id, name, context, None if streaming else producers_by_pcoll)

    split = reads.split_transform(stage.transforms)
    if split is not None:
      stage_plans.append(
          StagePlan(
              name=stage.name,
              kind='read',
              inputs={},
              outputs=outputs,
              input_coders={},
              output_coders=output_coders,
              read_payload=split.spec.payload,
              transform_names=[split.unique_name]))
      continue

    test_stream = next(
        (t for t in stage.transforms if t.spec.urn == TEST_STREAM_URN), None)
    if test_stream is not None:
      tag_of = {pcoll: tag for tag, pcoll in test_stream.outputs.items()}
      writes = {
          t.unique_name: tr.only_element(t.inputs.values())
          for t in stage.transforms if t.spec.urn == DATA_OUTPUT_URN}
      stage_plans.append(
          StagePlan(
              name=stage.name,
              kind='teststream',
              inputs={},
              outputs=outputs,
              input_coders={},
              output_coders=output_coders,
              read_payload=test_stream.spec.payload,
              output_tags={w: tag_of[p] for w, p in writes.items()},
              element_coders={w: channel[p] for w, p in writes.items()},
              transform_names=[test_stream.unique_name],
              nested_elements=any(
                  teststream_elements_nested(components, p)
                  for p in writes.values())))
      continue

    if reshuffle is not None:
      main = reshuffles.main_input(reshuffle, producers_by_pcoll, _SPLIT_URNS)
      # Beam's expand_sdf gives the Reshuffle between splitting and
      # processing restrictions all the splittable ParDo's inputs, its side
      # inputs too; fusion makes each a data input. Only the restrictions
      # are reshuffled: the side inputs are read where they are used.
      for name, pcoll in input_pcolls.items():
        if pcoll != main:
          inputs.pop(name)
          input_coders.pop(name)
      out_pcoll = tr.only_element(reshuffle.outputs.values())
      sized = any(
          c.spec.urn in SDF_CONSUMER_URNS
          for c in consumers_by_pcoll.get(out_pcoll, []))
      stage_plans.append(
          StagePlan(
              name=stage.name,
              kind='reshuffle',
              inputs=inputs,
              outputs=outputs,
              input_coders=input_coders,
              output_coders=output_coders,
              sized=sized,
              keeps_keys=not sized and reshuffles.keeps_keys(
                  components, reshuffle),
              transform_names=[t.unique_name for t in stage.transforms]))
      continue

    side_inputs = []
    timers = []
    for t in stage.transforms:
      if t.spec.urn not in tr.PAR_DO_URNS:
        continue
      payload = proto_utils.parse_Bytes(
          t.spec.payload, beam_runner_api_pb2.ParDoPayload)
      for tag, si in payload.side_inputs.items():
        pcoll = t.inputs[tag]
        side_inputs.append(
            SideInputSpec(
                transform_id=t.unique_name,
                tag=tag,
                buffer_id=tr.create_buffer_id(pcoll),
                access_pattern=si.access_pattern.urn,
                coder_id=safe_coder(channel[pcoll])))
      for family_id, spec in payload.timer_family_specs.items():
        timers.append(
            TimerSpec(
                transform_id=t.unique_name,
                family_id=family_id,
                coder_id=safe_coder(spec.timer_family_coder_id),
                time_domain=spec.time_domain))

    descriptor = beam_fn_api_pb2.ProcessBundleDescriptor(
        id=stage.name,
        transforms=transforms,
        pcollections=dict(components.pcollections.items()),
        coders=dict(components.coders.items()),
        windowing_strategies=dict(components.windowing_strategies.items()),
        environments=dict(components.environments.items()),
        timer_api_service_descriptor=endpoints_pb2.ApiServiceDescriptor(
            url=PLACEHOLDER_ENDPOINT))
    stage_plans.append(
        StagePlan(
            name=stage.name,
            kind='sdk',
            inputs=inputs,
            outputs=outputs,
            input_coders=input_coders,
            output_coders=output_coders,
            descriptor=descriptor.SerializeToString(),
            side_inputs=side_inputs,
            timers=timers,
            stateful=stage.is_stateful(),
            transform_names=[t.unique_name for t in stage.transforms],
            environment_id=stage.environment or '',
            state_backed_iterables=paging))

  adopt_environments(stage_plans, components)
  return ExecutionPlan(
      components=components.SerializeToString(),
      stages=_producers_first(stage_plans),
      groups=groups)


def _producers_first(stages: list[StagePlan]) -> list[StagePlan]:
  """The stages ordered so that each comes after the producers of what it
  reads (main and side inputs), otherwise in fusion's order.

  Fusion orders stages by the inputs they had when fused; the Reshuffle
  that expand_sdf inserts listed the ParDo's side inputs as well, and once
  the plan drops them (``reshuffles.main_input``) fusion's order may put
  that Reshuffle before the stage that splits the restrictions it moves,
  which then read a buffer nothing had written yet (empty output, on some
  hash seeds).
  """
  producers: dict[bytes, set[int]] = {}
  for i, stage in enumerate(stages):
    for buffer_id in stage.outputs.values():
      producers.setdefault(buffer_id, set()).add(i)
  needs = [{p for b in [*stage.inputs.values(),
                        *(si.buffer_id for si in stage.side_inputs)]
            for p in producers.get(b, ()) if p != i}
           for i, stage in enumerate(stages)]
  ordered, placed = [], set()
  while len(ordered) < len(stages):
    ready = [i for i in range(len(stages))
             if i not in placed and needs[i] <= placed]
    if not ready:
      raise ValueError('the fused stages read each other\'s output in a cycle')
    ordered.append(ready[0])
    placed.add(ready[0])
  return [stages[i] for i in ordered]


def _grpc_port(coder_id: str, url: Optional[str] = None) -> bytes:
  port = beam_fn_api_pb2.RemoteGrpcPort(coder_id=coder_id)
  port.api_service_descriptor.url = url or PLACEHOLDER_ENDPOINT
  return port.SerializeToString()


def _group_spec(buffer_id: bytes, gbk_transform_id: str, context,
                producers: Optional[dict]) -> GroupSpec:
  components = context.components
  transform = components.transforms[gbk_transform_id]
  input_pcoll = tr.only_element(list(transform.inputs.values()))
  output_pcoll = tr.only_element(list(transform.outputs.values()))
  in_coder = context.data_channel_coders[input_pcoll]
  out_coder = context.data_channel_coders[output_pcoll]
  safe_in = context.safe_coders.get(in_coder, in_coder)
  safe_out = context.safe_coders.get(out_coder, out_coder)
  ws_id = components.pcollections[input_pcoll].windowing_strategy_id
  ws = components.windowing_strategies[ws_id]
  in_windowed, opaque = grouping_coders(context, in_coder, safe_in)
  out_windowed, _ = grouping_coders(context, out_coder, safe_out)
  return GroupSpec(
      buffer_id=buffer_id,
      transform_name=transform.unique_name,
      safe_input_coder_id=safe_in,
      safe_output_coder_id=safe_out,
      input_coder_id=in_windowed,
      output_coder_id=out_windowed,
      windowing_strategy_id=ws_id,
      default_windowing=is_default_windowing(ws),
      opaque_windows=opaque,
      final_panes=closes_windows_at_end(components, ws),
      fires_per_element=fires_per_element(components, input_pcoll),
      one_key=producers is not None and lifting.keyed_by_none_only(
          producers, input_pcoll))


def is_default_windowing(ws: beam_runner_api_pb2.WindowingStrategy) -> bool:
  """Global window, default trigger, default timestamp handling.

  Decided on the proto (no user code is unpickled while planning): only
  then may the reduce side group pure bytes and stamp one global pane.
  """
  return (
      ws.window_fn.urn == common_urns.global_windows.urn and
      ws.trigger.WhichOneof('trigger') == 'default' and
      ws.merge_status == beam_runner_api_pb2.MergeStatus.NON_MERGING and
      ws.accumulation_mode in (
          beam_runner_api_pb2.AccumulationMode.DISCARDING,
          beam_runner_api_pb2.AccumulationMode.UNSPECIFIED) and
      ws.output_time == beam_runner_api_pb2.OutputTime.END_OF_WINDOW and
      ws.allowed_lateness == 0)
