"""Which fused batch stages may skip the SDK harness, decided on their protos.

Most of a WordCount's CPU goes to Beam's per-element machinery (operations,
receivers, DoFn runners, windowed values), not to the user's functions
(docs/benchmarks.md, "Where the time goes"). A fused stage that starts with

    a data input (the splits of a bounded read, read in the stage,
    encoded elements, or a GroupByKey's grouped output) -> a tree of
    ParDos (Map, FlatMap, Filter, MapTuple, Partition, DoFns of the
    user's own...), WindowIntos of non-merging WindowFns, lifted
    combines' precombines and their MergeAccumulators and ExtractOutputs
    -> data outputs (GroupByKeys' shuffles, materialized buffers), or
    nothing (a ParDo run for its side effects)

needs none of it: ``worker.fastpath`` runs that tree as one loop over the
partition, calling the DoFns and the combines' ``add_input``, and writes
the same encoded elements, shuffle records, element counts and metrics
as the harness. A stage with a transform the loop cannot run hands a
PCollection to the harness, which runs the rest of the stage in the same
task (``FastPath.rest_stage``): the loop runs the stage's steps up to
there, as long as they form a chain (one consumer each, one output).
Everything the loop cannot express sends the rest of the partition to the
harness, which stays the reference.

This module decides what the protos can tell: the shape of the tree, the
payloads' fields (side inputs read whole, not as multimaps; no state,
timers, restrictions, bundle finalization, time-sorted input), the
environment (the in-process harness's: the other environments run user
code elsewhere on purpose) and non-merging windowing on every PCollection
of it. What only the pickled objects tell (a DoFn whose ``process`` takes
only what the loop can give it; a combine of Beam's own) is checked where
they are unpickled (``worker.fastpath.chain.load``); a step found wanting
there ends the chain before it (``max_steps``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional
from typing import Union

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.planning.plan import DATA_OUTPUT_URN
from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.planning.plan import is_default_windowing
from beam_pyspark.planning.reads import READ_SPLIT_URN
from beam_pyspark.planning.validate import concrete_environment

PAR_DO_URN = common_urns.primitives.PAR_DO.urn
PRECOMBINE_URN = common_urns.combine_components.COMBINE_PER_KEY_PRECOMBINE.urn
MERGE_URN = (
    common_urns.combine_components.COMBINE_PER_KEY_MERGE_ACCUMULATORS.urn)
EXTRACT_URN = common_urns.combine_components.COMBINE_PER_KEY_EXTRACT_OUTPUTS.urn
WINDOWED_VALUE_CODER_URN = common_urns.coders.WINDOWED_VALUE.urn

WINDOW_INTO_URN = common_urns.primitives.ASSIGN_WINDOWS.urn
GLOBAL_WINDOWS_URN = common_urns.global_windows.urn

PARDO = 'pardo'
PRECOMBINE = 'precombine'
# A lifted combine's reduce side: (key, accumulators) -> (key, merged), and
# (key, accumulator) -> (key, output) (Beam's CombineOperation phases).
MERGE = 'merge'
EXTRACT = 'extract'
GLOBAL_WINDOW = 'global_window'  # WindowInto(GlobalWindows()) in global
ASSIGN_WINDOWS = 'assign_windows'  # WindowInto of another WindowFn
FLATTEN = 'flatten'  # a Flatten inside the stage (sink_flattens' transcoding)
FLATTEN_URN = common_urns.primitives.FLATTEN.urn
# Name the records stage (FastPath.records_stage), the rest stage
# (FastPath.rest_stage) and their inputs' coders.
RECORDS_SUFFIX = '/records'
REST_SUFFIX = '/rest'
ITERABLE_SIDE_INPUT_URN = common_urns.side_inputs.ITERABLE.urn
# A ParDo's main output, when it has several (Beam's DoOperation.setup).
MAIN_TAG = 'None'


@dataclasses.dataclass(frozen=True)
class SideInput:
  """A ParDo's side input, read whole and handed to its DoFn."""
  tag: str
  pcoll: str
  payload: bytes  # the serialized SideInput (access pattern, view fn)


@dataclasses.dataclass(frozen=True)
class Step:
  """One transform of the tree."""
  transform_id: str
  name: str  # the transform's unique name, as errors and metrics name it
  kind: str  # PARDO, PRECOMBINE, MERGE, EXTRACT, GLOBAL_WINDOW or
             # ASSIGN_WINDOWS
  payload: bytes  # the pickled DoFnInfo, the CombinePayload, or the
                  # WindowingStrategy
  input_pcoll: str
  # (tag, PCollection) per output, in the proto's order.
  outputs: tuple[tuple[str, str], ...]
  side_inputs: tuple[SideInput, ...] = ()
  # The input's windowing strategy (a precombine keys by window unless it
  # is the default one).
  input_windowing: str = ''
  # A ParDo's DoFn URN: a pickled DoFnInfo, or one of Beam's stateless
  # DoFns known by URN (CombineGlobally's KeyWithVoid).
  dofn_urn: str = python_urns.PICKLED_DOFN_INFO
  # A Flatten's other inputs.
  extra_inputs: tuple[str, ...] = ()

  @property
  def inputs(self) -> tuple[str, ...]:
    return (self.input_pcoll, ) + self.extra_inputs

  @property
  def output_pcoll(self) -> str:
    """The main output: the only one, or the one tagged 'None'."""
    if len(self.outputs) == 1:
      return self.outputs[0][1]
    return dict(self.outputs).get(MAIN_TAG, '')


@dataclasses.dataclass(frozen=True)
class Output:
  """A DATA_OUTPUT the loop writes (or the rest stage's input)."""
  transform_id: str
  pcoll: str
  # The SDK's data channel coder (a windowed coder); for the rest stage's
  # input, the PCollection's coder, windowed with ``window_coder_id``.
  coder_id: str
  window_coder_id: str = ''


@dataclasses.dataclass(frozen=True)
class FastPath:
  """A stage's tree, with what the loop needs to read and write it.

  Coder ids are the SDK's (the data channel's), not the runner-safe ones:
  the loop decodes and encodes elements as the harness would.
  """
  input_id: str  # the stage's DATA_INPUT transform
  input_pcoll: str
  input_coder_id: str
  # A bounded read's splits are read in the loop: the reading transform's
  # output PCollection and its coder and window coder; '' otherwise.
  read_pcoll: str
  read_coder_id: str
  read_window_coder_id: str
  steps: tuple[Step, ...]  # upstream first
  # The DATA_OUTPUTs the loop writes; with a rest stage, its input.
  outputs: tuple[Output, ...]
  # For a read: the stage with the read cut off, fed the records instead of
  # the splits, where the harness takes over from the loop mid-partition.
  records_stage: Optional[StagePlan] = None
  # Where the chain stops short of the stage's outputs: the last step's
  # PCollection (written to the rest stage as ``outputs[0]``), the rest
  # of the stage (fed that PCollection's elements) and why the loop stops
  # there.
  boundary_pcoll: str = ''
  rest_stage: Optional[StagePlan] = None
  rest_why: str = ''
  # Whether any PCollection of the tree has windowing other than the
  # default global one.
  windowed: bool = False
  # Whether the input is a GroupByKey's output (key, values): the task
  # grouped it, a large group's values beyond the inline part in pages
  # (worker.shuffle.paging), read again on every iteration.
  grouped: bool = False

  @property
  def output_ids(self) -> list[str]:
    return [o.transform_id for o in self.outputs]

  def pcollections(self) -> list[str]:
    """Every PCollection whose elements the loop counts, in tree order
    (the rest stage counts the boundary's)."""
    read = [self.read_pcoll] if self.read_pcoll else []
    return [self.input_pcoll] + read + [
        pcoll for s in self.steps for _, pcoll in s.outputs]


def examine(stage: StagePlan, components: beam_runner_api_pb2.Components,
            max_steps: Optional[int] = None,
            reduce_side: bool = True) -> Union[FastPath, str]:
  """The stage's tree if its protos allow the fast path, else why not.

  The whole stage if the loop can run all of it; else the chain of steps
  up to the first transform it cannot run, or that has several consumers
  or outputs (then the harness runs the rest of the stage,
  ``FastPath.rest_stage``), or up to ``max_steps`` ParDos.
  ``reduce_side``: whether a stage reading a GroupByKey's output may take
  the fast path.
  """
  if stage.kind != 'sdk':
    return f'a {stage.kind} stage'
  if stage.stateful or stage.timers:
    return 'it has state or timers'
  env = components.environments.get(stage.environment_id)
  if env is None or concrete_environment(env).urn != (
      python_urns.EMBEDDED_PYTHON):
    return 'its environment runs user code outside this Python worker'
  if len(stage.inputs) != 1:
    return f'{len(stage.inputs)} inputs'
  descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
      stage.descriptor)
  transforms = descriptor.transforms
  consumers: dict[str, list[str]] = {}
  for transform_id, t in transforms.items():
    for pcoll in t.inputs.values():
      consumers.setdefault(pcoll, []).append(transform_id)
  (input_id, buffer_id), = stage.inputs.items()
  grouped = (buffer_id != IMPULSE_BUFFER and
             tr.split_buffer_id(buffer_id)[0] == 'group')
  if grouped and not reduce_side:
    return 'it reads a GroupByKey\'s output (the reduce side is off)'
  input_pcoll = _only(transforms[input_id].outputs)
  if not _non_merging(components, input_pcoll):
    return f'{input_pcoll!r} is in merging windows'
  start, read_id = input_pcoll, None
  after = consumers.get(input_pcoll, [])
  if len(after) == 1 and transforms[after[0]].spec.urn == READ_SPLIT_URN:
    read_id = after[0]
    start = _only(transforms[read_id].outputs)

  tree = None if max_steps is not None else _tree(
      start, consumers, transforms, components)
  if isinstance(tree, tuple):
    steps, outputs = tree
    boundary, why = '', ''
  else:
    steps, boundary, why = _chain(start, consumers, transforms, components,
                                  max_steps)
    outputs = []
    if not steps:
      return why or tree or 'nothing for the loop to run'
  pcolls = [input_pcoll] + [p for s in steps for _, p in s.outputs]
  windowed = not all(_global(components, p) for p in pcolls)

  read_pcoll = read_coder = read_window_coder = ''
  records_stage = None
  if read_id is not None:
    read_pcoll = start
    read_coder, read_window_coder = _coders(components, read_pcoll)
    records_stage = _rewired(
        stage, descriptor, input_id, [read_id], read_pcoll, read_coder,
        read_window_coder, RECORDS_SUFFIX)
  rest_stage = None
  if boundary:
    # The loop writes the last step's elements to the harness, which runs
    # the rest of the stage in the same task.
    value_coder, window_coder = _coders(components, boundary)
    rest_stage = _rewired(
        stage, descriptor, input_id,
        ([read_id] if read_id else []) + [s.transform_id for s in steps],
        boundary, value_coder, window_coder, REST_SUFFIX)
    outputs = [Output(input_id, boundary, value_coder, window_coder)]
  return FastPath(
      input_id=input_id,
      input_pcoll=input_pcoll,
      input_coder_id=_port_coder(transforms[input_id]),
      read_pcoll=read_pcoll,
      read_coder_id=read_coder,
      read_window_coder_id=read_window_coder,
      steps=tuple(steps),
      outputs=tuple(outputs),
      records_stage=records_stage,
      boundary_pcoll=boundary,
      rest_stage=rest_stage,
      rest_why=why,
      windowed=windowed,
      grouped=grouped)


def _tree(start: str, consumers, transforms, components
          ) -> Union[tuple[list[Step], list[Output]], str]:
  """Every transform after ``start`` as steps and outputs, or why the
  loop cannot run one of them."""
  steps: list[Step] = []
  outputs: list[Output] = []
  pending = [start]
  produced: set = set()
  waiting: dict[str, str] = {}
  while pending:
    pcoll = pending.pop(0)
    for transform_id in consumers.get(pcoll, []):
      t = transforms[transform_id]
      if t.spec.urn == DATA_OUTPUT_URN:
        outputs.append(Output(transform_id, pcoll, _port_coder(t)))
        continue
      if any(s.transform_id == transform_id for s in steps):
        continue  # a Flatten, reached through another of its inputs
      why = _why_not(t, consumers, transforms, components)
      if why:
        return why
      step = _step(transform_id, t, components)
      if not all(p == start or p in produced for p in step.inputs):
        waiting[transform_id] = t.unique_name
        continue  # a Flatten: reached again through its other inputs
      waiting.pop(transform_id, None)
      steps.append(step)
      produced.update(p for _, p in step.outputs)
      pending.extend(p for _, p in step.outputs)
  if waiting:
    return f'{next(iter(waiting.values()))!r} reads a PCollection from ' \
        'outside the stage\'s loop'
  if not steps and not outputs:
    return 'nothing for the loop to run'
  return steps, outputs


def _chain(start: str, consumers, transforms, components,
           max_steps: Optional[int]) -> tuple[list[Step], str, str]:
  """The steps after ``start`` while each has one consumer and one output
  and the loop can run it: (steps, the last one's PCollection, why the
  chain stops there)."""
  steps: list[Step] = []
  pcoll, why = start, ''
  while True:
    after = consumers.get(pcoll, [])
    if len(after) != 1:
      why = (f'{len(after)} transforms read {pcoll!r}' if after else
             f'nothing reads {pcoll!r}')
      break
    t = transforms[after[0]]
    if t.spec.urn == DATA_OUTPUT_URN:
      why = 'the stage ends there'
      break
    why = _why_not(t, consumers, transforms, components)
    if not why and len(t.outputs) != 1:
      why = f'{t.unique_name!r} has {len(t.outputs)} outputs'
    if not why and t.spec.urn == PRECOMBINE_URN:
      why = f'the combine {t.unique_name!r} ends the stage'
    if not why and max_steps is not None and len(steps) >= max_steps:
      why = f'{t.unique_name!r} is not a DoFn the loop runs'
    if why:
      break
    steps.append(_step(after[0], t, components))
    pcoll = steps[-1].output_pcoll
  return steps, pcoll, why


def _step(transform_id: str, t: beam_runner_api_pb2.PTransform,
          components) -> Step:
  kind = {PRECOMBINE_URN: PRECOMBINE, WINDOW_INTO_URN: ASSIGN_WINDOWS,
          FLATTEN_URN: FLATTEN, MERGE_URN: MERGE,
          EXTRACT_URN: EXTRACT}.get(t.spec.urn, PARDO)
  payload = t.spec.payload
  side_inputs = ()
  main_input = [p for tag, p in t.inputs.items()]
  dofn_urn = python_urns.PICKLED_DOFN_INFO
  if kind == PARDO:
    pardo = beam_runner_api_pb2.ParDoPayload.FromString(payload)
    payload = pardo.do_fn.payload
    dofn_urn = pardo.do_fn.urn
    side_inputs = tuple(
        SideInput(tag, t.inputs[tag], si.SerializeToString())
        for tag, si in sorted(pardo.side_inputs.items()))
    main_input = [p for tag, p in t.inputs.items()
                  if tag not in pardo.side_inputs]
  elif kind == ASSIGN_WINDOWS:
    ws = beam_runner_api_pb2.WindowingStrategy.FromString(payload)
    if ws.window_fn.urn == GLOBAL_WINDOWS_URN and _global(
        components, main_input[0]):
      kind = GLOBAL_WINDOW
  input_pcoll, extra_inputs = main_input[0], tuple(main_input[1:])
  return Step(
      transform_id=transform_id, name=t.unique_name, kind=kind,
      payload=payload, input_pcoll=input_pcoll,
      outputs=tuple(t.outputs.items()), side_inputs=side_inputs,
      input_windowing=components.pcollections[
          input_pcoll].windowing_strategy_id,
      dofn_urn=dofn_urn, extra_inputs=extra_inputs)


def _windowing(components, pcoll: str):
  return components.windowing_strategies[
      components.pcollections[pcoll].windowing_strategy_id]


def _global(components, pcoll: str) -> bool:
  return is_default_windowing(_windowing(components, pcoll))


def _non_merging(components, pcoll: str) -> bool:
  return _windowing(components, pcoll).merge_status == (
      beam_runner_api_pb2.MergeStatus.NON_MERGING)


def _coders(components, pcoll: str) -> tuple[str, str]:
  """A PCollection's coder and its windowing's window coder."""
  proto = components.pcollections[pcoll]
  return proto.coder_id, components.windowing_strategies[
      proto.windowing_strategy_id].window_coder_id


def _why_not(t: beam_runner_api_pb2.PTransform, consumers, transforms,
             components) -> str:
  """Why the loop cannot run ``t`` ('' if it can)."""
  name = repr(t.unique_name)
  for out in t.outputs.values():
    if not _non_merging(components, out):
      return f'{out!r} is in merging windows'
  if t.spec.urn == PRECOMBINE_URN:
    out = _only(t.outputs)
    after = consumers.get(out, [])
    if len(after) != 1 or transforms[after[0]].spec.urn != DATA_OUTPUT_URN:
      return f'the combine {name} is not the stage\'s last step'
    combine = beam_runner_api_pb2.CombinePayload.FromString(t.spec.payload)
    if combine.combine_fn.urn != python_urns.PICKLED_COMBINE_FN:
      return f'the combine {name} is not a pickled Python CombineFn'
    ws = _windowing(components, _only(t.inputs))
    if ws.output_time != beam_runner_api_pb2.OutputTime.END_OF_WINDOW:
      return f'the combine {name} combines timestamps'
    return ''
  if t.spec.urn in (MERGE_URN, EXTRACT_URN):
    combine = beam_runner_api_pb2.CombinePayload.FromString(t.spec.payload)
    if combine.combine_fn.urn != python_urns.PICKLED_COMBINE_FN:
      return f'the combine {name} is not a pickled Python CombineFn'
    return ''
  if t.spec.urn == FLATTEN_URN:
    if len(t.outputs) != 1 or len(set(t.inputs.values())) != len(t.inputs):
      return f'{name} flattens a PCollection with itself'
    return ''
  if t.spec.urn == WINDOW_INTO_URN:
    ws = beam_runner_api_pb2.WindowingStrategy.FromString(t.spec.payload)
    if ws.window_fn.urn != GLOBAL_WINDOWS_URN and (
        ws.window_fn.urn != python_urns.PICKLED_WINDOWFN and
        ws.window_fn.urn not in _STANDARD_WINDOW_FNS):
      return f'{name} assigns windows of {ws.window_fn.urn}'
    return ''
  if t.spec.urn != PAR_DO_URN:
    return f'{name} is a {t.spec.urn} transform'
  payload = beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload)
  if payload.do_fn.urn not in (python_urns.PICKLED_DOFN_INFO,
                               python_urns.KEY_WITH_NONE_DOFN):
    return f'{name} is not a pickled Python DoFn'
  if (payload.state_specs or payload.timer_family_specs or
      payload.on_window_expiration_timer_family_spec):
    return f'{name} has state or timers'
  if payload.restriction_coder_id:
    return f'{name} is splittable'
  if payload.requests_finalization:
    return f'{name} asks for bundle finalization'
  if payload.requires_time_sorted_input:
    return f'{name} requires time-sorted input'
  if payload.requires_stable_input:
    return f'{name} requires stable input'
  for tag, si in payload.side_inputs.items():
    if si.access_pattern.urn != ITERABLE_SIDE_INPUT_URN:
      return f'{name} reads a multimap side input'
    if not _global(components, t.inputs[tag]):
      return f'{name} reads a side input in other windows'
  return ''


_STANDARD_WINDOW_FNS = frozenset([
    common_urns.fixed_windows.urn, common_urns.sliding_windows.urn])


def _rewired(stage: StagePlan, descriptor, input_id: str,
             removed: list[str], pcoll: str, value_coder: str,
             window_coder: str, suffix: str) -> StagePlan:
  """The stage without the ``removed`` transforms: its data input reads
  ``pcoll``'s elements instead (encoded with the PCollection's coder, in
  its windows), where the harness takes over from the loop."""
  rest = copy.deepcopy(descriptor)
  name = stage.name + suffix
  rest.id = name
  names = {rest.transforms[t].unique_name for t in removed}
  for transform_id in removed:
    del rest.transforms[transform_id]
  coder_id = f'{value_coder}/windowed{suffix}'
  rest.coders[coder_id].CopyFrom(
      beam_runner_api_pb2.Coder(
          spec=beam_runner_api_pb2.FunctionSpec(urn=WINDOWED_VALUE_CODER_URN),
          component_coder_ids=[value_coder, window_coder]))
  source = rest.transforms[input_id]
  port = beam_fn_api_pb2.RemoteGrpcPort.FromString(source.spec.payload)
  port.coder_id = coder_id
  source.spec.payload = port.SerializeToString()
  source.outputs.clear()
  source.outputs['out'] = pcoll
  return dataclasses.replace(
      stage,
      name=name,
      input_coders={input_id: coder_id},
      descriptor=rest.SerializeToString(),
      transform_names=[n for n in stage.transform_names if n not in names])


def _only(mapping) -> str:
  (value,) = mapping.values()
  return value


def _port_coder(transform: beam_runner_api_pb2.PTransform) -> str:
  return beam_fn_api_pb2.RemoteGrpcPort.FromString(
      transform.spec.payload).coder_id
