"""Which fused batch stages may skip the SDK harness, decided on their protos.

Most of a WordCount's CPU goes to Beam's per-element machinery (operations,
receivers, DoFn runners, windowed values), not to the user's functions
(README, "Where the time goes"). A fused stage that starts with

    a data input (the splits of a bounded read, read in the stage, or
    encoded elements) -> ParDos of plain callables (Map, FlatMap)
    -> a lifted combine's precombine, or nothing more
    -> one data output (a GroupByKey's shuffle, or a materialized buffer)

(``WindowInto(GlobalWindows())`` passed through, and Beam's own file
writer as the loop's sink: ``worker.fastpath.sinks.Writer``) needs none
of it: ``worker.fastpath`` runs that chain as one loop over the
partition that calls the callables and the combine's ``add_input``, and
writes the same encoded elements, shuffle records and element counts as
the harness. A chain that stops short of the stage's output, at a
transform the loop cannot run (a DoFn of the user's own, a sink's
writer), hands its last PCollection to the harness, which runs the rest
of the stage in the same task (``FastPath.rest_stage``). Everything the
loop cannot express (timestamps, windows, tagged outputs, metrics,
errors) sends the rest of the partition to the harness, which stays the
reference.

This module decides what the protos can tell: the shape of the chain, the
payloads' fields (side inputs read whole, not as multimaps; no state,
timers, restrictions, bundle finalization, time-sorted input; one
output), the environment (the in-process harness's: the other
environments run user code elsewhere on purpose) and default global
windowing on every PCollection of it. What only the pickled objects tell
(a plain callable, not a DoFn of the user's own; its side inputs as its
only placeholders; a combine of Beam's own) is checked where they are
unpickled (``worker.fastpath.chain.load``); a step found wanting there
ends the chain before it (``max_steps``).
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
WINDOWED_VALUE_CODER_URN = common_urns.coders.WINDOWED_VALUE.urn

WINDOW_INTO_URN = common_urns.primitives.ASSIGN_WINDOWS.urn
GLOBAL_WINDOWS_URN = common_urns.global_windows.urn

PARDO = 'pardo'
PRECOMBINE = 'precombine'
GLOBAL_WINDOW = 'global_window'  # WindowInto(GlobalWindows()) in global
# Name the records stage (FastPath.records_stage), the rest stage
# (FastPath.rest_stage) and their inputs' coders.
RECORDS_SUFFIX = '/records'
REST_SUFFIX = '/rest'
ITERABLE_SIDE_INPUT_URN = common_urns.side_inputs.ITERABLE.urn


@dataclasses.dataclass(frozen=True)
class SideInput:
  """A ParDo's side input, read whole and handed to its callable."""
  tag: str
  pcoll: str
  payload: bytes  # the serialized SideInput (access pattern, view fn)


@dataclasses.dataclass(frozen=True)
class Step:
  """One transform of the chain."""
  transform_id: str
  name: str  # the transform's unique name, as errors and metrics name it
  kind: str  # PARDO, PRECOMBINE or GLOBAL_WINDOW
  payload: bytes  # the pickled DoFnInfo, the CombinePayload, or the
                  # WindowingStrategy
  output_pcoll: str
  side_inputs: tuple[SideInput, ...] = ()


@dataclasses.dataclass(frozen=True)
class FastPath:
  """A stage's chain, with what the loop needs to read and write it.

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
  steps: tuple[Step, ...]
  # The stage's DATA_OUTPUT transform that the chain writes, or '' when the
  # harness runs the rest of the stage (rest_stage).
  output_id: str
  output_coder_id: str
  # For a read: the stage with the read cut off, fed the records instead of
  # the splits, where the harness takes over from the loop mid-partition.
  records_stage: Optional[StagePlan] = None
  # Where the chain stops short of the stage's output: the last step's
  # PCollection, its coders, the rest of the stage (fed that PCollection's
  # elements) and why the loop stops there.
  boundary_pcoll: str = ''
  boundary_coder_id: str = ''
  boundary_window_coder_id: str = ''
  rest_stage: Optional[StagePlan] = None
  rest_why: str = ''

  def pcollections(self) -> list[str]:
    """Every PCollection whose elements the loop counts, in chain order
    (the rest stage counts the boundary's)."""
    read = [self.read_pcoll] if self.read_pcoll else []
    return [self.input_pcoll] + read + [s.output_pcoll for s in self.steps]


def examine(stage: StagePlan, components: beam_runner_api_pb2.Components,
            max_steps: Optional[int] = None) -> Union[FastPath, str]:
  """The stage's chain if its protos allow the fast path, else why not.

  The chain is as long as the stage allows: up to its output, or up to
  the first transform the loop cannot run (then the harness runs the rest
  of the stage, ``FastPath.rest_stage``), or ``max_steps`` ParDos.
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
  if (buffer_id != IMPULSE_BUFFER and
      tr.split_buffer_id(buffer_id)[0] == 'group'):
    return ('it reads a GroupByKey\'s output, whose large groups come in '
            'pages over the state API')
  input_pcoll = _only(transforms[input_id].outputs)
  if not _global(components, input_pcoll):
    return f'{input_pcoll!r} is not in the default global windowing'

  read_id, output_id, why = None, '', ''
  steps: list[Step] = []
  pcoll = input_pcoll
  while True:
    after = consumers.get(pcoll, [])
    if not after and steps:
      # A last step whose output nothing reads is there for its side
      # effects (a sink's finalization): the harness runs it.
      last = steps.pop()
      why = f'nothing reads the output of {last.name!r}'
      pcoll = steps[-1].output_pcoll if steps else (
          _only(transforms[read_id].outputs) if read_id else input_pcoll)
      break
    if len(after) != 1:
      why = f'{len(after)} transforms read {pcoll!r}'
      break
    t = transforms[after[0]]
    if t.spec.urn == DATA_OUTPUT_URN:
      output_id = after[0]
      break
    if t.spec.urn == READ_SPLIT_URN and pcoll == input_pcoll:
      read_id = after[0]
      pcoll = _only(t.outputs)
      continue
    why = _why_not(t, consumers, transforms, components)
    if not why and max_steps is not None and len(steps) >= max_steps:
      why = f'{t.unique_name!r} is not a plain callable'
    if why:
      break
    kind = {PRECOMBINE_URN: PRECOMBINE, WINDOW_INTO_URN: GLOBAL_WINDOW}.get(
        t.spec.urn, PARDO)
    payload = t.spec.payload
    side_inputs = ()
    if kind == PARDO:
      pardo = beam_runner_api_pb2.ParDoPayload.FromString(payload)
      payload = pardo.do_fn.payload
      side_inputs = tuple(
          SideInput(tag, t.inputs[tag], si.SerializeToString())
          for tag, si in sorted(pardo.side_inputs.items()))
    steps.append(
        Step(transform_id=after[0], name=t.unique_name, kind=kind,
             payload=payload, output_pcoll=_only(t.outputs),
             side_inputs=side_inputs))
    pcoll = _only(t.outputs)
  if not steps:
    return why or 'no ParDo or combine to run'

  read_pcoll = read_coder = read_window_coder = ''
  records_stage = None
  if read_id is not None:
    read_pcoll = _only(transforms[read_id].outputs)
    read_coder, read_window_coder = _coders(components, read_pcoll)
    records_stage = _rewired(
        stage, descriptor, input_id, [read_id], read_pcoll, read_coder,
        read_window_coder, RECORDS_SUFFIX)
  rest_stage = None
  boundary = boundary_coder = boundary_window_coder = ''
  if not output_id:
    # The loop writes the last step's elements to the harness, which runs
    # the rest of the stage in the same task.
    boundary = pcoll
    boundary_coder, boundary_window_coder = _coders(components, boundary)
    rest_stage = _rewired(
        stage, descriptor, input_id,
        ([read_id] if read_id else []) + [s.transform_id for s in steps],
        boundary, boundary_coder, boundary_window_coder, REST_SUFFIX)
  return FastPath(
      input_id=input_id,
      input_pcoll=input_pcoll,
      input_coder_id=_port_coder(transforms[input_id]),
      read_pcoll=read_pcoll,
      read_coder_id=read_coder,
      read_window_coder_id=read_window_coder,
      steps=tuple(steps),
      output_id=output_id,
      output_coder_id=_port_coder(transforms[output_id]) if output_id else '',
      records_stage=records_stage,
      boundary_pcoll=boundary,
      boundary_coder_id=boundary_coder,
      boundary_window_coder_id=boundary_window_coder,
      rest_stage=rest_stage,
      rest_why=why)


def _global(components, pcoll: str) -> bool:
  return is_default_windowing(components.windowing_strategies[
      components.pcollections[pcoll].windowing_strategy_id])


def _coders(components, pcoll: str) -> tuple[str, str]:
  """A PCollection's coder and its windowing's window coder."""
  proto = components.pcollections[pcoll]
  return proto.coder_id, components.windowing_strategies[
      proto.windowing_strategy_id].window_coder_id


def _why_not(t: beam_runner_api_pb2.PTransform, consumers, transforms,
             components) -> str:
  """Why the loop cannot run ``t`` ('' if it can)."""
  name = repr(t.unique_name)
  if len(t.outputs) != 1:
    return f'{name} has {len(t.outputs)} outputs'
  out = _only(t.outputs)
  if not _global(components, out):
    return f'{out!r} is not in the default global windowing'
  if t.spec.urn == PRECOMBINE_URN:
    after = consumers.get(out, [])
    if len(after) != 1 or transforms[after[0]].spec.urn != DATA_OUTPUT_URN:
      return f'the combine {name} is not the stage\'s last step'
    combine = beam_runner_api_pb2.CombinePayload.FromString(t.spec.payload)
    if combine.combine_fn.urn != python_urns.PICKLED_COMBINE_FN:
      return f'the combine {name} is not a pickled Python CombineFn'
    return ''
  if t.spec.urn == WINDOW_INTO_URN:
    # Into the global window from the global window: the element as it is
    # but for its pane (the loop checks its input's is the default one).
    ws = beam_runner_api_pb2.WindowingStrategy.FromString(t.spec.payload)
    if ws.window_fn.urn != GLOBAL_WINDOWS_URN or not _global(
        components, _only(t.inputs)):
      return f'{name} assigns windows other than the global one'
    return ''
  if t.spec.urn != PAR_DO_URN:
    return f'{name} is a {t.spec.urn} transform'
  payload = beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload)
  if payload.do_fn.urn != python_urns.PICKLED_DOFN_INFO:
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
  for tag, si in payload.side_inputs.items():
    if si.access_pattern.urn != ITERABLE_SIDE_INPUT_URN:
      return f'{name} reads a multimap side input'
    if not _global(components, t.inputs[tag]):
      return f'{name} reads a side input in other windows'
  return ''


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
