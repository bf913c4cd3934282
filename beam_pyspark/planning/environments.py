"""Environment overrides: a container image mapped to a process or a pool.

Beam's SDKs default to DOCKER environments (Java's and Go's clients always,
Python's PortableRunner too), and an expansion service's transforms come in
Docker environments of their own. Spark executors have no Docker daemon
(YARN and Kubernetes executors do not either), so a DOCKER environment
cannot run as it is. An override names images by a glob and says what runs
instead, as the SDK's container would have run it:

    IMAGE_GLOB=process:COMMAND      beam:env:process:v1 with this command
    IMAGE_GLOB=external:HOST:PORT   beam:env:external:v1, a worker pool
    IMAGE_GLOB=embedded             the embedded Python harness (Python
                                    images only: executors run Beam's Python)

given to the job server (``--environment-override``, repeatable) or with a
job (``--environment_override``). The job's own come first, then the
server's, then the defaults for Beam's own images (``DEFAULT_OVERRIDES``):
Java, Go and TypeScript images boot their SDK's harness with ``python -m
beam_pyspark.boot``, Python images run embedded. The environment keeps its
id, capabilities and dependencies (staged artifacts reach the harness over
the Fn API); only how it starts changes. A DOCKER environment no override
matches is refused at Prepare, naming its image.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable
from typing import Sequence

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.portability.api import endpoints_pb2

DOCKER = common_urns.environments.DOCKER.urn
PROCESS = common_urns.environments.PROCESS.urn
EXTERNAL = common_urns.environments.EXTERNAL.urn
ANYOF = common_urns.environments.ANYOF.urn


@dataclasses.dataclass(frozen=True)
class EnvironmentOverride:
  """One ``IMAGE_GLOB=SPEC`` mapping."""
  pattern: str
  urn: str
  payload: bytes
  text: str  # as given, for messages

  @classmethod
  def parse(cls, text: str) -> 'EnvironmentOverride':
    """Raises ValueError naming the accepted forms."""
    pattern, sep, spec = text.partition('=')
    pattern, spec = pattern.strip(), spec.strip()
    if not sep or not pattern or not spec:
      raise ValueError(
          f'Environment override {text!r} is not IMAGE_GLOB=SPEC; e.g. '
          '"apache/beam_java*=process:python -m beam_pyspark.boot java" or '
          '"my/image:*=external:localhost:50000" or '
          '"apache/beam_python*=embedded".')
    kind, _, rest = spec.partition(':')
    kind = kind.strip().lower()
    if kind == 'process' and rest.strip():
      return cls(pattern, PROCESS, beam_runner_api_pb2.ProcessPayload(
          command=rest.strip()).SerializeToString(), text)
    if kind == 'external' and rest.strip():
      return cls(pattern, EXTERNAL, beam_runner_api_pb2.ExternalPayload(
          endpoint=endpoints_pb2.ApiServiceDescriptor(url=rest.strip())
      ).SerializeToString(), text)
    if kind == 'embedded' and not rest.strip():
      return cls(pattern, python_urns.EMBEDDED_PYTHON, b'', text)
    raise ValueError(
        f'Environment override {text!r}: the part after "=" must be '
        '"process:COMMAND", "external:HOST:PORT" or "embedded".')

  def matches(self, image: str) -> bool:
    return fnmatch.fnmatchcase(image, self.pattern)


# Beam's own images. ``python`` is the executor's own interpreter: the
# runner puts its directory first on a PROCESS command's PATH.
DEFAULT_OVERRIDES: tuple[EnvironmentOverride, ...] = tuple(
    EnvironmentOverride.parse(text) for text in (
        'apache/beam_java*_sdk*=process:python -m beam_pyspark.boot java',
        'apache/beam_go_sdk*=process:python -m beam_pyspark.boot go',
        # The TypeScript SDK names its image with the registry in front
        # (docker.io/apache/beam_typescript_sdk:2.49.0).
        '*apache/beam_typescript_sdk*='
        'process:python -m beam_pyspark.boot typescript',
        'apache/beam_python*_sdk*=embedded',
    ))


def parse_all(texts: Iterable[str]) -> list[EnvironmentOverride]:
  return [EnvironmentOverride.parse(t) for t in texts or ()]


def docker_image(env: beam_runner_api_pb2.Environment) -> str:
  return beam_runner_api_pb2.DockerPayload.FromString(
      env.payload).container_image


def apply_overrides(
    pipeline: beam_runner_api_pb2.Pipeline,
    overrides: Sequence[EnvironmentOverride],
    defaults: Sequence[EnvironmentOverride] = DEFAULT_OVERRIDES) -> list[str]:
  """Rewrites, in place, each DOCKER environment an override matches (the
  first that does); returns a message per rewritten environment."""
  notes = []
  for env_id, env in pipeline.components.environments.items():
    for where, member in _dockers(env_id, env):
      image = docker_image(member)
      match = next(
          (o for o in list(overrides) + list(defaults) if o.matches(image)),
          None)
      if match is None:
        continue
      member.urn = match.urn
      member.payload = match.payload
      notes.append(
          f'Environment {where!r} (Docker image {image!r}) runs as '
          f'{_describe(match)} (override {match.text!r}): Spark executors '
          'have no Docker daemon.')
  return notes


def _dockers(env_id: str, env: beam_runner_api_pb2.Environment):
  if env.urn == DOCKER:
    yield env_id, env
  elif env.urn == ANYOF:
    payload = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
        env.payload)
    members = list(payload.environments)
    changed = False
    for i, member in enumerate(members):
      if member.urn == DOCKER:
        before = member.SerializeToString()
        yield f'{env_id}[{i}]', member
        changed |= member.SerializeToString() != before
    if changed:
      env.payload = beam_runner_api_pb2.AnyOfEnvironmentPayload(
          environments=members).SerializeToString()


def _describe(override: EnvironmentOverride) -> str:
  if override.urn == PROCESS:
    return 'a process: ' + beam_runner_api_pb2.ProcessPayload.FromString(
        override.payload).command
  if override.urn == EXTERNAL:
    return 'an external worker pool at ' + (
        beam_runner_api_pb2.ExternalPayload.FromString(
            override.payload).endpoint.url)
  return 'the embedded Python harness'
