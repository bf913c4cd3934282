"""Refuse, before anything runs, a pipeline we cannot execute.

Every reason is collected and reported in one error (as Prism does at
Prepare), so that a user fixes them all at once instead of one per attempt.
Only protos are inspected: no user code is unpickled here, since the job
server may not be able to import the user's modules.
"""

from __future__ import annotations

from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr
from apache_beam.utils import proto_utils

from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.planning import sdks

SUPPORTED_REQUIREMENTS = frozenset([
    common_urns.requirements.REQUIRES_STATEFUL_PROCESSING.urn,
    common_urns.requirements.REQUIRES_BUNDLE_FINALIZATION.urn,
    common_urns.requirements.REQUIRES_SPLITTABLE_DOFN.urn,
    # Every stage reads materialized (persisted or shuffled) input, so a
    # retried bundle sees the same elements.
    common_urns.requirements.REQUIRES_STABLE_INPUT.urn,
])

# Environments whose harness we can run, by URN, in order of preference
# within an AnyOf environment: in process first, then over the gRPC Fn API.
PREFERRED_ENVIRONMENTS = (
    python_urns.EMBEDDED_PYTHON,
    common_urns.environments.PROCESS.urn,
    common_urns.environments.EXTERNAL.urn,  # LOOPBACK arrives as EXTERNAL
    python_urns.SUBPROCESS_SDK,
    python_urns.EMBEDDED_PYTHON_GRPC,
)
SUPPORTED_ENVIRONMENTS = frozenset(PREFERRED_ENVIRONMENTS)

# Transforms the runner itself executes (everything else runs in an SDK).
RUNNER_PRIMITIVES = frozenset([
    common_urns.primitives.IMPULSE.urn,
    common_urns.primitives.GROUP_BY_KEY.urn,
    common_urns.primitives.FLATTEN.urn,
    common_urns.composites.RESHUFFLE.urn,
])

SUPPORTED_TIME_DOMAINS = frozenset([
    beam_runner_api_pb2.TimeDomain.EVENT_TIME,
    beam_runner_api_pb2.TimeDomain.PROCESSING_TIME,
])


def unsupported_reasons(
    pipeline: beam_runner_api_pb2.Pipeline,
    supported_environments: frozenset[str] = SUPPORTED_ENVIRONMENTS,
) -> list[str]:
  reasons: list[str] = []
  components = pipeline.components

  for requirement in pipeline.requirements:
    if requirement not in SUPPORTED_REQUIREMENTS:
      reasons.append(f'pipeline requirement {requirement} is not supported')

  for env_id, env in components.environments.items():
    if env.urn == common_urns.environments.DOCKER.urn:
      image = beam_runner_api_pb2.DockerPayload.FromString(
          env.payload).container_image
      reasons.append(
          f'environment {env_id!r} ({env.urn}) is Docker image {image!r}, '
          'and Spark executors have no Docker daemon: map the image to a '
          'process or '
          'a worker pool, e.g. --environment-override '
          f'\'{image or "IMAGE"}=process:COMMAND\' (job server) or '
          '--environment_override (pipeline option), or submit with '
          '--environment_type=LOOPBACK, PROCESS or (Python) '
          f'{python_urns.EMBEDDED_PYTHON}')
      continue
    if not _env_ok(env, supported_environments):
      reasons.append(
          f'environment {env_id!r} ({env.urn}) is not supported; '
          f'supported: {", ".join(sorted(supported_environments))}')
      continue
    chosen = concrete_environment(env, supported_environments)
    if chosen.urn == common_urns.environments.PROCESS.urn:
      payload = beam_runner_api_pb2.ProcessPayload.FromString(chosen.payload)
      if not payload.command.strip():
        reasons.append(
            f'environment {env_id!r} is PROCESS without a command: pass '
            '--environment_config=\'{"command": "..."}\', e.g. '
            '"python -m apache_beam.runners.worker.sdk_worker_main"')
    elif chosen.urn == common_urns.environments.EXTERNAL.urn:
      payload = beam_runner_api_pb2.ExternalPayload.FromString(chosen.payload)
      if not payload.endpoint.url:
        reasons.append(
            f'environment {env_id!r} is EXTERNAL without a worker pool '
            'address: pass --environment_config=HOST:PORT')

  # Coders: any SDK's coders travel length-prefixed as opaque bytes (Beam's
  # TransformContext wraps them); the runner decodes only model coders. What
  # it cannot do without the SDK is merge windows of a WindowFn that Python
  # does not know.
  for ws_id, ws in components.windowing_strategies.items():
    if (ws.merge_status == beam_runner_api_pb2.MergeStatus.NEEDS_MERGE and
        not (sdks.python_knows_window_fn(ws.window_fn.urn) and
             sdks.python_knows_coder(components, ws.window_coder_id)) and
        _grouped(pipeline, ws_id)):
      reasons.append(
          f'windowing strategy {ws_id!r} merges windows with '
          f'{ws.window_fn.urn} (window coder '
          f'{components.coders[ws.window_coder_id].spec.urn}), which only '
          f'its SDK knows, and {_grouped(pipeline, ws_id)!r} groups them: '
          'the runner merges windows of the WindowFns and window coders '
          'Python knows (sessions among them)')
    trigger = sdks.trigger_problem(ws.trigger) if _grouped(
        pipeline, ws_id) else None
    if trigger:
      reasons.append(
          f'{_grouped(pipeline, ws_id)!r} groups with {trigger}; the runner '
          'runs Beam\'s triggers with Python\'s trigger driver')

  test_streams: list[str] = []
  structure = _structure_reasons(pipeline)
  if structure:
    # Nothing below can walk a malformed tree safely.
    return reasons + structure
  for transform_id in _leaf_transforms(pipeline):
    transform = components.transforms[transform_id]
    urn = transform.spec.urn
    name = transform.unique_name or transform_id
    if urn == common_urns.primitives.TEST_STREAM.urn:
      test_streams.append(name)  # replayed by the streaming engine
      continue
    if urn in RUNNER_PRIMITIVES:
      continue
    if not transform.environment_id:
      if urn == common_urns.deprecated_primitives.READ.urn:
        continue  # turned into an SDK read by read_to_impulse
      reasons.append(
          f'transform {name!r} ({urn or "no URN"}) is neither a runner '
          'primitive nor assigned to an SDK environment')
      continue
    if urn in tr.PAR_DO_URNS:
      try:
        payload = proto_utils.parse_Bytes(
            transform.spec.payload, beam_runner_api_pb2.ParDoPayload)
      except Exception as exn:  # pylint: disable=broad-except
        reasons.append(
            f'transform {name!r} is a ParDo whose payload is not a valid '
            f'ParDoPayload ({type(exn).__name__}: {exn})')
        continue
      for timer_id, spec in payload.timer_family_specs.items():
        if spec.time_domain not in SUPPORTED_TIME_DOMAINS:
          reasons.append(
              f'timer {timer_id!r} of {name!r} uses time domain '
              f'{beam_runner_api_pb2.TimeDomain.Enum.Name(spec.time_domain)}'
              '; supported: EVENT_TIME, PROCESSING_TIME')
      if payload.requires_time_sorted_input:
        reasons.append(
            f'transform {name!r} requires time-sorted input, which is not '
            'supported')
  if len(test_streams) > 1:
    reasons.append(
        f'the pipeline has {len(test_streams)} TestStreams '
        f'({", ".join(repr(n) for n in sorted(test_streams))}); Beam\'s '
        'runners replay one: give one TestStream tagged outputs instead')
  return reasons


def check_supported(
    pipeline: beam_runner_api_pb2.Pipeline,
    supported_environments: frozenset[str] = SUPPORTED_ENVIRONMENTS) -> None:
  reasons = unsupported_reasons(pipeline, supported_environments)
  if reasons:
    raise UnsupportedPipelineError(reasons)


def concrete_environment(
    env: beam_runner_api_pb2.Environment,
    supported: frozenset[str] = SUPPORTED_ENVIRONMENTS,
) -> beam_runner_api_pb2.Environment:
  """The environment we run for ``env``: an AnyOf's most preferred member."""
  if env.urn != common_urns.environments.ANYOF.urn:
    return env
  payload = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(env.payload)
  candidates = [
      concrete_environment(e, supported) for e in payload.environments]
  candidates = [e for e in candidates if e.urn in supported]
  if not candidates:
    return env
  rank = {urn: i for i, urn in enumerate(PREFERRED_ENVIRONMENTS)}
  return min(candidates, key=lambda e: rank.get(e.urn, len(rank)))


def _grouped(pipeline: beam_runner_api_pb2.Pipeline, ws_id: str) -> str:
  """The name of a GroupByKey whose input has windowing ``ws_id``."""
  components = pipeline.components
  for transform in components.transforms.values():
    if transform.spec.urn != common_urns.primitives.GROUP_BY_KEY.urn:
      continue
    for pcoll in transform.inputs.values():
      if components.pcollections[pcoll].windowing_strategy_id == ws_id:
        return transform.unique_name
  return ''


def _env_ok(env, supported) -> bool:
  if env.urn == common_urns.environments.ANYOF.urn:
    payload = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
        env.payload)
    return any(_env_ok(e, supported) for e in payload.environments)
  return env.urn in supported


# Structural problems reported at most, so that a hostile pipeline's
# refusal stays small.
MAX_STRUCTURE_REASONS = 10


def _structure_reasons(pipeline: beam_runner_api_pb2.Pipeline) -> list[str]:
  """What makes the transform tree not a tree, found in linear time.

  Every transform id it names must exist; each transform has at most one
  place in the tree (one parent, or a root); and no chain of parents loops.
  (A pipeline Beam's SDKs build always passes; a hand-made or hostile one
  could otherwise send the walk below round a cycle for ever.)
  """
  transforms = pipeline.components.transforms
  if not pipeline.root_transform_ids:
    if not transforms:
      # An empty pipeline (`with beam.Pipeline() as p: pass`, or one whose
      # every apply raised) is Beam's: its runners run it to DONE.
      return []
    return [f'the pipeline has {len(transforms)} transform(s) but no root '
            'transform: there is nothing to run']
  reasons: list[str] = []

  def name(tid):
    t = transforms.get(tid)
    return repr(t.unique_name or tid) if t is not None else repr(tid)

  parent: dict[str, Optional[str]] = {}
  for tid in pipeline.root_transform_ids:
    if tid not in transforms:
      reasons.append(f'root transform {tid!r} is not among the pipeline\'s '
                     'transforms')
    elif tid in parent:
      reasons.append(f'transform {name(tid)} is listed twice as a root')
    else:
      parent[tid] = None
  for tid, transform in transforms.items():
    if len(reasons) >= MAX_STRUCTURE_REASONS:
      break
    for child in transform.subtransforms:
      if child not in transforms:
        reasons.append(f'transform {name(tid)} lists a subtransform '
                       f'{child!r} that is not among the pipeline\'s '
                       'transforms')
      elif child == tid:
        reasons.append(f'transform {name(tid)} lists itself as a '
                       'subtransform')
      elif child in parent:
        where = ('a root' if parent[child] is None else
                 f'a subtransform of {name(parent[child])}')
        reasons.append(f'transform {name(child)} appears twice in the '
                       f'transform tree: in {name(tid)} and as {where}')
      else:
        parent[child] = tid
  if reasons:
    return reasons[:MAX_STRUCTURE_REASONS]
  # Each transform has at most one parent now: a loop is a chain of parents
  # that never reaches a root. Memoised, so linear overall.
  settled: set[str] = set()
  for start in parent:
    chain, seen, tid = [], set(), start
    while tid is not None and tid not in settled:
      if tid in seen:
        reasons.append(f'transforms form a cycle through {name(tid)}')
        break
      seen.add(tid)
      chain.append(tid)
      tid = parent.get(tid)
    settled.update(chain)
    if len(reasons) >= MAX_STRUCTURE_REASONS:
      break
  return reasons


def _leaf_transforms(pipeline: beam_runner_api_pb2.Pipeline):
  """Leaves of the transform tree, stopping at runner-executed composites."""
  transforms = pipeline.components.transforms
  stack = list(pipeline.root_transform_ids)
  while stack:
    transform_id = stack.pop()
    transform = transforms[transform_id]
    if transform.subtransforms and transform.spec.urn not in RUNNER_PRIMITIVES:
      stack.extend(transform.subtransforms)
    else:
      yield transform_id
