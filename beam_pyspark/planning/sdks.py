"""What the runner may know of another SDK's coders, windows and harness.

Beam's portable runners understand the model coders only; every other
coder travels length-prefixed as opaque bytes (Beam's ``TransformContext``
wraps them, and its runner-safe coders read them as bytes). Python is the
runner's own language, so where Python knows a coder or a WindowFn (a
Python pipeline's custom windows) the runner may use it; where it does not
(Java's, Go's, TypeScript's), the runner works on bytes and model windows.
An environment says which optional coders and protocols its harness has in
its capabilities; the runner uses one only when it is listed.
"""

from __future__ import annotations

import re
from typing import Optional

from apache_beam.coders import coders as beam_coders
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr
from apache_beam.transforms import window


def grouping_coders(context, sdk_coder_id: str, safe_coder_id: str
                   ) -> tuple[str, bool]:
  """The coder a windowed grouping decodes (and encodes) elements with, and
  whether its windows are opaque to the runner.

  Elements: the runner-safe coder's (every coder the runner does not know
  is opaque bytes: any SDK's keys and values). Windows: as the SDK encodes
  them, where Python knows their coder (model windows, and a custom window
  whose coder Python knows, such as a Python pipeline's own, which a
  merging WindowFn must see as itself); else the runner-safe coder's
  timestamp-prefixed opaque window (its max timestamp and its bytes), which
  a non-merging WindowFn can group (``worker.runtime.opaque_windowing``;
  planning.validate refuses the merging ones).
  """
  components = context.components
  sdk = components.coders[sdk_coder_id]
  safe = components.coders[safe_coder_id]
  windowed = common_urns.coders.WINDOWED_VALUE.urn
  if sdk.spec.urn != windowed or safe.spec.urn != windowed:
    return safe_coder_id, False
  sdk_window = sdk.component_coder_ids[1]
  if sdk_window == safe.component_coder_ids[1]:
    return safe_coder_id, False
  if not python_knows_coder(components, sdk_window):
    return safe_coder_id, True
  return context.add_or_get_coder_id(
      beam_runner_api_pb2.Coder(
          spec=safe.spec,
          component_coder_ids=[safe.component_coder_ids[0], sdk_window]),
      safe_coder_id + '_windows'), False


def teststream_elements_nested(components: beam_runner_api_pb2.Components,
                               pcoll_id: str) -> bool:
  """Whether a TestStream's elements for ``pcoll_id`` are encoded in the
  nested context. Python's and Java's TestStreams encode an element as a
  whole (the outer context); Go's ``teststream`` in the nested one (a
  string or byte slice gets its length in front), and its own runner,
  Prism, reads them so. Told apart by the SDK of the transforms that read
  the PCollection."""
  for transform in components.transforms.values():
    if pcoll_id in transform.inputs.values() and transform.environment_id:
      env = components.environments.get(transform.environment_id)
      if env is not None and sdk_of(env) == 'go':
        return True
  return False


def fires_per_element(components: beam_runner_api_pb2.Components,
                      pcoll_id: str) -> bool:
  """Whether a GroupByKey of ``pcoll_id`` runs its trigger once per element
  rather than once per bundle of a key's elements. Beam's Python and Java
  DirectRunners give a bundle's elements (a TestStream event's) to the
  trigger together, and Python's TestStreamTest expects it (one early
  pane of an event's three elements under AfterCount(1)); Go's reference
  runner, Prism, runs the trigger after each element, and Go's trigger
  tests expect that (Always over one event of 1, 2, 3: panes 1, 2, 3).
  Each SDK's pipelines get their reference runner's firings: per element
  for a PCollection written or read by a Go transform."""
  for transform in components.transforms.values():
    if (pcoll_id in transform.inputs.values() or
        pcoll_id in transform.outputs.values()) and transform.environment_id:
      env = components.environments.get(transform.environment_id)
      if env is not None and sdk_of(env) == 'go':
        return True
  return False


def python_knows_coder(components: beam_runner_api_pb2.Components,
                       coder_id: str) -> bool:
  known = beam_coders.Coder._known_urns  # pylint: disable=protected-access
  stack, seen = [coder_id], set()
  while stack:
    cid = stack.pop()
    if cid in seen:
      continue
    seen.add(cid)
    coder = components.coders.get(cid)
    if coder is None or (coder.spec.urn not in known and
                         coder.spec.urn not in tr.TransformContext.
                         _REQUIRED_CODER_URNS):
      return False
    stack.extend(coder.component_coder_ids)
  return True


def python_knows_window_fn(urn: str) -> bool:
  return urn in window.WindowFn._known_urns  # pylint: disable=protected-access


def accepts_state_backed_iterables(
    components: beam_runner_api_pb2.Components, env_id: Optional[str]) -> bool:
  """Whether the environment lists state-backed iterables among its
  capabilities (an AnyOf environment: all of its members do)."""
  env = components.environments.get(env_id) if env_id else None
  if env is None:
    return False
  urn = common_urns.coders.STATE_BACKED_ITERABLE.urn
  if env.urn == common_urns.environments.ANYOF.urn:
    members = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
        env.payload).environments
    return bool(members) and all(urn in m.capabilities for m in members)
  return urn in env.capabilities


_SDK_BASE = 'beam:version:sdk_base:'


_SDKS = ('java', 'python', 'go', 'typescript')
_BOOT = re.compile(r'beam_pyspark\.boot\s+(\w+)')


def _sdk_of_image(image: str) -> str:
  name = image.rsplit(':', 1)[0].rsplit('/', 1)[-1]
  return next((sdk for sdk in _SDKS if sdk in name), name)


def sdk_of(env: beam_runner_api_pb2.Environment) -> str:
  """The SDK an environment runs: from its sdk_base capability (Beam's
  container image name, e.g. apache/beam_java17_sdk), else its Docker
  image or its PROCESS command's boot (the TypeScript SDK lists no
  sdk_base), else its URN."""
  if env.urn == common_urns.environments.ANYOF.urn:
    members = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
        env.payload).environments
    return sdk_of(members[0]) if members else 'any'
  for capability in env.capabilities:
    if capability.startswith(_SDK_BASE):
      return _sdk_of_image(capability[len(_SDK_BASE):])
  if env.urn == common_urns.environments.DOCKER.urn:
    return _sdk_of_image(beam_runner_api_pb2.DockerPayload.FromString(
        env.payload).container_image)
  if env.urn == common_urns.environments.PROCESS.urn:
    boot = _BOOT.search(beam_runner_api_pb2.ProcessPayload.FromString(
        env.payload).command)
    if boot:
      return boot.group(1)
  if 'python' in env.urn:
    return 'python'
  return 'unknown SDK'


def closes_windows_at_end(components: beam_runner_api_pb2.Components,
                          ws: beam_runner_api_pb2.WindowingStrategy) -> bool:
  """Whether a bounded GroupByKey in ``ws`` closes its windows at the end
  of input as Beam's model (Java's ReduceFnRunner) does: last panes marked
  so, EMIT_ALWAYS honoured (worker.shuffle.panes). For the windowing of
  SDKs other than Python, whose own runners (and ValidatesRunner tests)
  do so; a Python pipeline gets the panes of Python's trigger driver, as
  Beam's Python runners give them."""
  env = components.environments.get(ws.environment_id)
  return env is not None and sdk_of(env) != 'python'


def describe_environment(components: beam_runner_api_pb2.Components,
                         env_id: str) -> str:
  """``env_id`` as a person reads it: its SDK and how its harness runs,
  e.g. "java, process" or "python, embedded"."""
  env = components.environments.get(env_id) if env_id else None
  if env is None:
    return 'runner'
  kind = env.urn.split(':')[2] if env.urn.count(':') >= 3 else env.urn
  if env.urn == common_urns.environments.ANYOF.urn:
    kind = 'any of'
  elif env.urn == common_urns.environments.EXTERNAL.urn:
    kind = 'external'
  elif 'embedded' in env.urn:
    kind = 'embedded'
  return f'{sdk_of(env)}, {kind}'


def stages_by_environment(plan) -> str:
  """How many of a plan's stages run in each environment, e.g.
  "stages by environment: 'java' (java, process) 3, runner 2"."""
  components = beam_runner_api_pb2.Components.FromString(plan.components)
  counts: dict[str, int] = {}
  for stage in plan.stages:
    env_id = stage.environment_id if stage.kind == 'sdk' else ''
    counts[env_id] = counts.get(env_id, 0) + 1
  parts = [
      (f'{env_id!r} ({describe_environment(components, env_id)}) {n}'
       if env_id else f'runner {n}')
      for env_id, n in sorted(counts.items(), key=lambda kv: (not kv[0], kv[0]))]
  return 'stages by environment: ' + ', '.join(parts)


def adopt_environments(stages, components) -> None:
  """Stages fusion left without an environment (nothing but the runner's
  data transforms: a GroupByKey's output read and written again for a
  stateful stage that must start its own stage) run where their neighbours
  run when that is another SDK's harness: the embedded Python harness,
  which runs them otherwise, cannot build another SDK's coders (Java's
  GroupByKey before a DoFn with timers failed so)."""
  producers: dict[bytes, list] = {}
  consumers: dict[bytes, list] = {}
  for stage in stages:
    for buffer_id in stage.outputs.values():
      producers.setdefault(buffer_id, []).append(stage)
    for buffer_id in stage.inputs.values():
      consumers.setdefault(buffer_id, []).append(stage)
  for stage in stages:
    if stage.kind != 'sdk' or stage.environment_id:
      continue
    neighbours = [n for b in stage.outputs.values() for n in consumers.get(b, ())]
    neighbours += [n for b in stage.inputs.values() for n in producers.get(b, ())]
    for other in neighbours:
      env = components.environments.get(other.environment_id)
      if env is not None and sdk_of(env) != 'python':
        # Its grouped input stays inline (planned without state-backed
        # iterables, as for no environment).
        stage.environment_id = other.environment_id
        break


def normalized_trigger(trigger: beam_runner_api_pb2.Trigger
                       ) -> beam_runner_api_pb2.Trigger:
  """``trigger`` as Python's TriggerFn reads it. Java encodes
  ``AfterProcessingTime.pastFirstElementInPane()`` with no timestamp
  transform (no delay), where Python's decoder expects one: a zero delay
  says the same."""
  result = beam_runner_api_pb2.Trigger()
  result.CopyFrom(trigger)
  stack = [result]
  while stack:
    t = stack.pop()
    kind = t.WhichOneof('trigger')
    if kind == 'after_processing_time':
      if not t.after_processing_time.timestamp_transforms:
        t.after_processing_time.timestamp_transforms.add().delay.delay_millis = 0
    if kind is not None:
      stack.extend(_subtriggers(getattr(t, kind)))
  return result


def trigger_problem(trigger: beam_runner_api_pb2.Trigger) -> Optional[str]:
  """Why the runner cannot run ``trigger`` (it decodes it with Python's
  TriggerFn), or None."""
  from apache_beam.transforms.trigger import TriggerFn  # pylint: disable=import-outside-toplevel
  normal = normalized_trigger(trigger)
  stack = [normal]
  while stack:
    t = stack.pop()
    if t.WhichOneof('trigger') == 'after_processing_time':
      transforms = t.after_processing_time.timestamp_transforms
      if len(transforms) != 1 or transforms[0].WhichOneof(
          'timestamp_transform') != 'delay':
        return ('an AfterProcessingTime trigger with timestamp transforms '
                'other than one delay (alignment is not supported)')
    kind = t.WhichOneof('trigger')
    if kind is not None:
      stack.extend(_subtriggers(getattr(t, kind)))
  try:
    TriggerFn.from_runner_api(normal, None)
  except Exception as exn:  # pylint: disable=broad-except
    return f'a trigger Python cannot read ({type(exn).__name__}: {exn})'
  return None


def _subtriggers(message) -> list:
  """The Trigger messages a trigger kind's message holds."""
  found = []
  for name, field in message.DESCRIPTOR.fields_by_name.items():
    if (field.message_type is not None and field.message_type.full_name ==
        beam_runner_api_pb2.Trigger.DESCRIPTOR.full_name):
      if field.label == field.LABEL_REPEATED:
        found.extend(getattr(message, name))
      elif message.HasField(name):
        found.append(getattr(message, name))
  return found
