"""Which fused batch stages may skip the SDK harness, decided on their protos.

Most of a WordCount's CPU goes to Beam's per-element machinery (operations,
receivers, DoFn runners, windowed values), not to the user's functions
(README, "Where the time goes"). A fused stage that is only

    a data input (the splits of a bounded read, read in the stage, or
    encoded elements) -> ParDos of plain callables (Map, FlatMap)
    -> a lifted combine's precombine, or nothing more
    -> one data output (a GroupByKey's shuffle, or a materialized buffer)

needs none of it: ``worker.fastpath`` runs it as one loop over the
partition that calls the callables and the combine's ``add_input``, and
writes the same encoded elements, shuffle records and element counts as
the harness. Everything the loop cannot express (timestamps, windows,
tagged outputs, metrics, errors) sends the rest of the partition to the
harness, which stays the reference.

This module decides what the protos can tell: the shape of the chain, the
payloads' fields (no side inputs, state, timers, restrictions, bundle
finalization, time-sorted input; one output), the environment (the
in-process harness's: the other environments run user code elsewhere on
purpose) and default global windowing on every PCollection of it. What
only the pickled objects tell (a plain callable, not a DoFn of the user's
own; no extra arguments; a combine of Beam's own) is checked where they
are unpickled (``worker.fastpath.chain.load``).
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

from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.planning.plan import is_default_windowing
from beam_pyspark.planning.reads import READ_SPLIT_URN
from beam_pyspark.planning.validate import concrete_environment

PAR_DO_URN = common_urns.primitives.PAR_DO.urn
PRECOMBINE_URN = common_urns.combine_components.COMBINE_PER_KEY_PRECOMBINE.urn
WINDOWED_VALUE_CODER_URN = common_urns.coders.WINDOWED_VALUE.urn

PARDO = 'pardo'
PRECOMBINE = 'precombine'
# Names the records stage (FastPath.records_stage) and its input's coder.
RECORDS_SUFFIX = '/records'


@dataclasses.dataclass(frozen=True)
class Step:
  """One transform of the chain."""
  transform_id: str
  name: str  # the transform's unique name, as errors and metrics name it
  kind: str  # PARDO or PRECOMBINE
  payload: bytes  # the pickled DoFnInfo, or the CombinePayload
  output_pcoll: str


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
  output_id: str  # the stage's DATA_OUTPUT transform
  output_coder_id: str
  # For a read: the stage with the read cut off, fed the records instead of
  # the splits, where the harness takes over from the loop mid-partition.
  records_stage: Optional[StagePlan] = None

  def pcollections(self) -> list[str]:
    """Every PCollection whose elements the loop counts, in chain order."""
    read = [self.read_pcoll] if self.read_pcoll else []
    return [self.input_pcoll] + read + [s.output_pcoll for s in self.steps]


def examine(stage: StagePlan,
            components: beam_runner_api_pb2.Components) -> Union[FastPath, str]:
  """The stage's chain if its protos allow the fast path, else why not."""
  if stage.kind != 'sdk':
    return f'a {stage.kind} stage'
  if stage.stateful or stage.timers:
    return 'it has state or timers'
  if stage.side_inputs:
    return 'it reads side inputs'
  env = components.environments.get(stage.environment_id)
  if env is None or concrete_environment(env).urn != (
      python_urns.EMBEDDED_PYTHON):
    return 'its environment runs user code outside this Python worker'
  if len(stage.inputs) != 1 or len(stage.outputs) != 1:
    return (f'{len(stage.inputs)} inputs and {len(stage.outputs)} outputs, '
            'not one of each')
  descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
      stage.descriptor)
  transforms = descriptor.transforms
  consumers: dict[str, list[str]] = {}
  for transform_id, t in transforms.items():
    for pcoll in t.inputs.values():
      consumers.setdefault(pcoll, []).append(transform_id)
  (input_id, buffer_id), = stage.inputs.items()
  (output_id, _), = stage.outputs.items()
  if (buffer_id != IMPULSE_BUFFER and
      tr.split_buffer_id(buffer_id)[0] == 'group'):
    return ('it reads a GroupByKey\'s output, whose large groups come in '
            'pages over the state API')
  input_pcoll = _only(transforms[input_id].outputs)
  chain, pcoll = [], input_pcoll
  while True:
    after = consumers.get(pcoll, [])
    if len(after) != 1:
      return f'{len(after)} transforms read {pcoll!r}: not a chain'
    transform_id = after[0]
    if transform_id == output_id:
      break
    t = transforms[transform_id]
    if len(t.inputs) != 1 or len(t.outputs) != 1:
      return f'{t.unique_name!r} has {len(t.inputs)} inputs and ' \
             f'{len(t.outputs)} outputs'
    chain.append((transform_id, t))
    pcoll = _only(t.outputs)
  if len(chain) + 2 != len(transforms):
    return 'transforms off the chain'
  for pcoll in [input_pcoll] + [_only(t.outputs) for _, t in chain]:
    ws = components.windowing_strategies[
        components.pcollections[pcoll].windowing_strategy_id]
    if not is_default_windowing(ws):
      return f'{pcoll!r} is not in the default global windowing'

  read_id = None
  if chain and chain[0][1].spec.urn == READ_SPLIT_URN:
    read_id, _ = chain.pop(0)
  steps = []
  for i, (transform_id, t) in enumerate(chain):
    why = _why_not(t, last=i == len(chain) - 1)
    if why:
      return why
    kind = PRECOMBINE if t.spec.urn == PRECOMBINE_URN else PARDO
    if kind == PARDO:
      payload = beam_runner_api_pb2.ParDoPayload.FromString(
          t.spec.payload).do_fn.payload
    else:
      payload = t.spec.payload
    steps.append(
        Step(transform_id=transform_id, name=t.unique_name, kind=kind,
             payload=payload,
             output_pcoll=_only(t.outputs)))
  if not steps:
    return 'no ParDo or combine to run'

  read_pcoll = read_coder = read_window_coder = ''
  records_stage = None
  if read_id is not None:
    read_pcoll = _only(transforms[read_id].outputs)
    read_coder = components.pcollections[read_pcoll].coder_id
    read_window_coder = components.windowing_strategies[
        components.pcollections[read_pcoll].windowing_strategy_id
    ].window_coder_id
    records_stage = _records_stage(
        stage, descriptor, input_id, read_id, read_pcoll,
        read_coder, read_window_coder)
  return FastPath(
      input_id=input_id,
      input_pcoll=input_pcoll,
      input_coder_id=_port_coder(transforms[input_id]),
      read_pcoll=read_pcoll,
      read_coder_id=read_coder,
      read_window_coder_id=read_window_coder,
      steps=tuple(steps),
      output_id=output_id,
      output_coder_id=_port_coder(transforms[output_id]),
      records_stage=records_stage)


def _why_not(t: beam_runner_api_pb2.PTransform, last: bool) -> str:
  name = repr(t.unique_name)
  if t.spec.urn == PRECOMBINE_URN:
    if not last:
      return f'the combine {name} is not the last step'
    combine = beam_runner_api_pb2.CombinePayload.FromString(t.spec.payload)
    if combine.combine_fn.urn != python_urns.PICKLED_COMBINE_FN:
      return f'the combine {name} is not a pickled Python CombineFn'
    return ''
  if t.spec.urn != PAR_DO_URN:
    return f'{name} is a {t.spec.urn} transform'
  payload = beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload)
  if payload.do_fn.urn != python_urns.PICKLED_DOFN_INFO:
    return f'{name} is not a pickled Python DoFn'
  if payload.side_inputs:
    return f'{name} reads side inputs'
  if (payload.state_specs or payload.timer_family_specs or
      payload.on_window_expiration_timer_family_spec):
    return f'{name} has state or timers'
  if payload.restriction_coder_id:
    return f'{name} is splittable'
  if payload.requests_finalization:
    return f'{name} asks for bundle finalization'
  if payload.requires_time_sorted_input:
    return f'{name} requires time-sorted input'
  return ''


def _records_stage(stage: StagePlan, descriptor, input_id: str, read_id: str,
                   read_pcoll: str, read_coder: str,
                   window_coder: str) -> StagePlan:
  """The stage without its read: a data input of the read's records (in
  global windows, as the reading transform emits them) in its place."""
  records = copy.deepcopy(descriptor)
  name = stage.name + RECORDS_SUFFIX
  records.id = name
  del records.transforms[read_id]
  coder_id = read_coder + '/windowed' + RECORDS_SUFFIX
  records.coders[coder_id].CopyFrom(
      beam_runner_api_pb2.Coder(
          spec=beam_runner_api_pb2.FunctionSpec(urn=WINDOWED_VALUE_CODER_URN),
          component_coder_ids=[read_coder, window_coder]))
  source = records.transforms[input_id]
  port = beam_fn_api_pb2.RemoteGrpcPort.FromString(source.spec.payload)
  port.coder_id = coder_id
  source.spec.payload = port.SerializeToString()
  source.outputs.clear()
  source.outputs['out'] = read_pcoll
  return dataclasses.replace(
      stage,
      name=name,
      input_coders={input_id: coder_id},
      descriptor=records.SerializeToString(),
      transform_names=[
          n for n in stage.transform_names
          if n != descriptor.transforms[read_id].unique_name])


def _only(mapping) -> str:
  (value,) = mapping.values()
  return value


def _port_coder(transform: beam_runner_api_pb2.PTransform) -> str:
  return beam_fn_api_pb2.RemoteGrpcPort.FromString(
      transform.spec.payload).coder_id
