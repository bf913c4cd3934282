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
    IMAGE_GLOB=versioned            a Python image of the job server's Beam
                                    version embedded, of another version in
                                    a harness of that version (boot.python:
                                    a cached virtualenv with that apache-beam
                                    from the package index)

given to the job server (``--environment-override``, repeatable) or with a
job (``--environment_override``). The job's own come first, then the
server's, then the defaults for Beam's own images (``DEFAULT_OVERRIDES``):
Java, Go and TypeScript images boot their SDK's harness with ``python -m
beam_pyspark.boot``, Python images of our Beam version run embedded, and
those of another version are refused (planning.versions: the embedded
harness cannot unpickle another version's functions), naming what works:
LOOPBACK, or ``=versioned``. The environment keeps its
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

from beam_pyspark.planning import versions

DOCKER = common_urns.environments.DOCKER.urn
PROCESS = common_urns.environments.PROCESS.urn
EXTERNAL = common_urns.environments.EXTERNAL.urn
ANYOF = common_urns.environments.ANYOF.urn
# Not an environment: resolved per image by apply_overrides.
VERSIONED = 'beam-pyspark:versioned'


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
    if kind == 'versioned' and not rest.strip():
      return cls(pattern, VERSIONED, b'', text)
    raise ValueError(
        f'Environment override {text!r}: the part after "=" must be '
        '"process:COMMAND", "external:HOST:PORT", "embedded" or '
        '"versioned".')

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
  first that does); returns a message per rewritten environment. Raises
  ValueError naming every Python environment of another Beam version that
  only a default would have mapped (to the embedded harness, which would
  fail to unpickle its functions)."""
  notes, refused = [], []
  for env_id, env in pipeline.components.environments.items():
    for where, member in _dockers(env_id, env):
      image = docker_image(member)
      match = next(
          (o for o in list(overrides) + list(defaults) if o.matches(image)),
          None)
      if match is None:
        continue
      version = versions.environment_version(member)
      urn, payload = match.urn, match.payload
      if urn == VERSIONED:
        urn, payload = _versioned(image, version)
        python = versions.image_python(image)
        if urn == PROCESS and python and python != versions.OUR_PYTHON:
          notes.append(
              f'Environment {where!r} is Python {python}; its harness of '
              f'Beam {version} runs on the executors\' Python (the job '
              f'server\'s is {versions.OUR_PYTHON}): code pickled by one '
              'Python version may fail to unpickle on another.')
      elif (urn == python_urns.EMBEDDED_PYTHON and version
            and not versions.same_minor(version)):
        if any(match is d for d in defaults):
          refused.append(_refusal(where, image, version))
          continue
        notes.append(
            f'Environment {where!r} is Beam {version}, the embedded harness '
            f'Beam {versions.OURS}: as override {match.text!r} says, but its '
            'functions may fail to unpickle (=versioned runs a harness of '
            f'Beam {version}).')
      member.urn = urn
      member.payload = payload
      notes.append(
          f'Environment {where!r} (Docker image {image!r}) runs as '
          f'{_describe(urn, payload)} (override {match.text!r}): Spark '
          'executors have no Docker daemon.')
  if refused:
    raise ValueError('\n'.join(refused))
  return notes


def _versioned(image: str, version) -> tuple[str, bytes]:
  """``=versioned``: our own version embedded, another in its own."""
  if not version or versions.same_minor(version):
    return python_urns.EMBEDDED_PYTHON, b''
  return PROCESS, beam_runner_api_pb2.ProcessPayload(
      command=f'python -m beam_pyspark.boot python --beam_version={version}'
  ).SerializeToString()


def _refusal(where: str, image: str, version: str) -> str:
  return (
      f'Environment {where!r} is Beam Python {version} (Docker image '
      f'{image!r}); this job server runs Beam {versions.OURS}, whose '
      'embedded harness cannot run functions another Beam version pickled. '
      'What works: submit with --environment_type=LOOPBACK (your own '
      f'harness runs the stages), or with apache-beam=={versions.OURS}, or '
      'let the job server run a harness of your version on its executors '
      '(installed from the package index into a cached virtualenv): '
      f"--environment_override='{image}=versioned' with the job, or "
      "--environment-override='apache/beam_python*_sdk*=versioned' on the "
      'job server.')


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


def _describe(urn: str, payload: bytes) -> str:
  if urn == PROCESS:
    return 'a process: ' + beam_runner_api_pb2.ProcessPayload.FromString(
        payload).command
  if urn == EXTERNAL:
    return 'an external worker pool at ' + (
        beam_runner_api_pb2.ExternalPayload.FromString(
            payload).endpoint.url)
  return 'the embedded Python harness'
