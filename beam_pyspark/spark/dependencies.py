"""A job's staged dependencies, from the driver to every executor.

The driver reads the artifacts of the environments its stages run in (local
files, in the job server's artifact directory or the runner's temporary
staging directory; URLs through Beam's file systems) and ships them in one
Spark broadcast, created for the job and destroyed with it. Executors install
them once per host (``beam_pyspark.worker.setup.dependencies``) when the job's
first task arrives.

Why a broadcast, not ``SparkContext.addFile``: files added to a context stay
in it for its whole life, are fetched by every executor that starts later
(a job server's context runs many jobs), cannot be removed, and clash by
file name across jobs (two jobs' ``requirements.txt``). A broadcast is the
job's own, reaches executors on every cluster manager through Spark's block
manager, and is fetched only by executors that run the job's tasks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import urllib.parse
import urllib.request
from typing import Callable
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning.sdks import sdk_of
from beam_pyspark.worker.setup import dependencies as worker_deps

_ARTIFACT_TYPES = common_urns.artifact_types
_ARTIFACT_ROLES = common_urns.artifact_roles


@dataclasses.dataclass
class ShippedDependencies:
  """Picklable: travels with every task of the job."""
  staged: worker_deps.DependencySet
  content: object  # Broadcast[dict[str, bytes]]

  def fetch(self):
    return self.content.value


def activate(shipped: Optional[ShippedDependencies]) -> None:
  """In a task: make the job's dependencies (and only them) importable."""
  if shipped is None:
    worker_deps.activate(None)
  else:
    worker_deps.activate(shipped.staged, shipped.fetch)


def ship_dependencies(
    sc, plan: ExecutionPlan,
    log: Callable[[str], None] = lambda text: None
) -> Optional[ShippedDependencies]:
  """Broadcasts the files executors need; None when there are none.

  The caller destroys ``content`` when the job ends.
  """
  contents, requirements = read_dependencies(plan, log)
  if not contents:
    return None
  staged = worker_deps.dependency_set(contents, requirements)
  log(
      f'Shipping {len(staged.files)} staged dependencies '
      f'({staged.total_bytes / 1e6:.1f} MB) to the executors: '
      f'{", ".join(staged.names())}')
  return ShippedDependencies(staged, sc.broadcast(contents))


def read_dependencies(
    plan: ExecutionPlan, log: Callable[[str], None] = lambda text: None
) -> tuple[dict[str, bytes], set[str]]:
  """(staged name -> content, names of pip requirements files).

  Every environment a stage runs in shares the executors' Python: their
  dependencies are installed together, and two different files under one
  name are an error.
  """
  components = beam_runner_api_pb2.Components.FromString(plan.components)
  # The environments the job's transforms run in (the expansion service's,
  # say, besides the pipeline's own).
  # Python environments only: another SDK's harness gets its environment's
  # artifacts itself, over the Fn API's artifact retrieval (boot/).
  env_ids = sorted({
      t.environment_id for t in components.transforms.values()
      if t.environment_id in components.environments and
      sdk_of(components.environments[t.environment_id]) == 'python'
  })
  contents: dict[str, bytes] = {}
  origins: dict[str, str] = {}
  requirements: set[str] = set()
  for env_id in env_ids:
    for artifact in _python_dependencies(components.environments[env_id]):
      name, is_requirements = staged_name(artifact)
      if name is None:
        log(f'Environment {env_id!r}: ignoring an artifact with role '
            f'{artifact.role_urn!r}')
        continue
      reason = worker_deps.skip_reason(name)
      if reason is not None:
        log(f'Not shipping {name!r} to executors: {reason}')
        continue
      data = read_artifact(artifact, f'{name!r} of environment {env_id!r}')
      previous = contents.get(name)
      if previous is not None and previous != data:
        raise PipelineExecutionError(
            f'Environments {origins[name]!r} and {env_id!r} both stage a '
            f'different {name!r}; executors share one Python, so their '
            'dependencies must agree.')
      contents[name] = data
      origins[name] = env_id
      if is_requirements:
        requirements.add(name)
  return contents, requirements


def _python_dependencies(env: beam_runner_api_pb2.Environment):
  if env.urn == common_urns.environments.ANYOF.urn:
    payload = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
        env.payload)
    for sub in payload.environments:
      if sub.urn == python_urns.EMBEDDED_PYTHON:
        return list(sub.dependencies)
    return []
  return list(env.dependencies)


def staged_name(
    artifact: beam_runner_api_pb2.ArtifactInformation
) -> tuple[Optional[str], bool]:
  """(name on executors, whether it is a pip requirements file).

  Names as Beam's stager gives them (``Stager.extract_staging_tuple_iter``):
  the staged name, or the digest of the artifact for a requirements file.
  """
  if artifact.role_urn == _ARTIFACT_ROLES.STAGING_TO.urn:
    role = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(
        artifact.role_payload)
    return role.staged_name, role.staged_name == worker_deps.REQUIREMENTS_FILE
  if artifact.role_urn == _ARTIFACT_ROLES.PIP_REQUIREMENTS_FILE.urn:
    return hashlib.sha256(artifact.SerializeToString()).hexdigest(), True
  return None, False


def read_artifact(
    artifact: beam_runner_api_pb2.ArtifactInformation, what: str) -> bytes:
  """An artifact's content, read on the driver.

  Raises PipelineExecutionError naming the artifact and where it was looked
  for.
  """
  urn = artifact.type_urn
  try:
    if urn == _ARTIFACT_TYPES.FILE.urn:
      path = beam_runner_api_pb2.ArtifactFilePayload.FromString(
          artifact.type_payload).path
      with open(path, 'rb') as f:
        return f.read()
    if urn == _ARTIFACT_TYPES.URL.urn:
      url = beam_runner_api_pb2.ArtifactUrlPayload.FromString(
          artifact.type_payload).url
      return _read_url(url)
    if urn == _ARTIFACT_TYPES.EMBEDDED.urn:
      return beam_runner_api_pb2.EmbeddedFilePayload.FromString(
          artifact.type_payload).data
  except Exception as exn:  # pylint: disable=broad-except
    # OSError, urllib's errors, Beam's BeamIOError: all mean unreadable.
    raise PipelineExecutionError(
        f'Cannot read the staged dependency {what}: {exn}') from exn
  raise PipelineExecutionError(
      f'The staged dependency {what} has type {urn!r}; supported: file, url, '
      'embedded.')


def _read_url(url: str) -> bytes:
  scheme = urllib.parse.urlsplit(url).scheme.lower()
  if scheme in ('http', 'https'):
    with urllib.request.urlopen(url, timeout=60) as response:
      return response.read()
  # file://, gs://, s3://, hdfs://...: whatever Beam's file systems reach.
  from apache_beam.io.filesystem import CompressionTypes
  from apache_beam.io.filesystems import FileSystems
  with FileSystems.open(
      url, compression_type=CompressionTypes.UNCOMPRESSED) as f:
    return f.read()
