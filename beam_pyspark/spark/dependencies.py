"""A job's staged dependencies, from the driver to every executor.

The driver serves the files of the job's environments where they lie
(the job server's artifact store, PySparkRunner's staging directory; a
URL artifact is downloaded to a temporary file first, streamed, and so is
embedded data written out) from its artifact server
(``artifacts.driver``), under a token of the job's own, for as long as
the job runs. Executors install the Python environments' files once per
host (``beam_pyspark.worker.setup.dependencies``) when the job's first
task arrives, streaming what their host lacks to disk
(``worker.setup.artifacts``); PROCESS harnesses of other SDKs get theirs
from the same server through the Fn API's artifact retrieval.

Why not a broadcast (as before): the driver read every file whole into
its Python, then pickled it into its JVM's heap: a 1 GiB dependency
killed the job server's JVM (``OutOfMemoryError: Java heap space``). Why
not ``SparkContext.addFile``: files added to a context stay in it for its
whole life, are fetched by every executor that starts later (a job
server's context runs many jobs), cannot be removed, and clash by file
name across jobs (two jobs' ``requirements.txt``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import socket
import tempfile
from typing import Callable
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.artifacts.driver import driver_server
from beam_pyspark.artifacts.retrieval import open_url
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning import versions
from beam_pyspark.planning.sdks import sdk_of
from beam_pyspark.worker.setup import artifacts as worker_artifacts
from beam_pyspark.worker.setup import dependencies as worker_deps

_LOGGER = logging.getLogger(__name__)

_ARTIFACT_TYPES = common_urns.artifact_types
_ARTIFACT_ROLES = common_urns.artifact_roles
_CHUNK = 2 << 20


@dataclasses.dataclass
class ShippedDependencies:
  """Picklable: travels with every task of the job."""
  staged: worker_deps.DependencySet  # the Python environments' files
  paths: dict  # staged name -> its path on the driver
  source: worker_artifacts.ArtifactSource


def activate(shipped: Optional[ShippedDependencies], job_id: str) -> None:
  """In a task: make the job's dependencies (and only them) importable,
  and its artifacts reachable by the harnesses this worker starts."""
  if shipped is None:
    worker_deps.activate(None)
    return
  worker_artifacts.register(job_id, shipped.source)
  worker_deps.activate(shipped.staged if shipped.staged.files else None,
                       shipped.source.fetcher(shipped.paths))


@dataclasses.dataclass
class Shipment:
  """The driver's side of a job's dependencies: what its tasks carry,
  and ``close()`` when the job ends (no longer served; temporary copies
  removed)."""
  shipped: ShippedDependencies
  _close: Callable[[], None]

  def close(self) -> None:
    self._close()


def ship_dependencies(
    sc, plan: ExecutionPlan,
    log: Callable[[str], None] = lambda text: None,
    address: Optional[tuple[str, str, int]] = None) -> Optional[Shipment]:
  """Serves the files executors need; None when there are none.
  ``address``: (bind, advertised, port) of the server, when there is no
  SparkContext to read them from (the Connect engine's client)."""
  scratch = tempfile.mkdtemp(prefix='beam-pyspark-driver-artifacts-')
  try:
    files = collect_dependencies(plan, scratch, log)
    harness_paths = harness_artifacts(plan)
  except BaseException:
    shutil.rmtree(scratch, ignore_errors=True)
    raise
  if not files and not harness_paths:
    shutil.rmtree(scratch, ignore_errors=True)
    return None
  server = driver_server(*(address or _driver_address(sc)))
  token = server.register([p for _, p in files] + harness_paths)
  staged = worker_deps.files_set(f for f, _ in files)
  if files:
    log(f'Serving {len(files)} staged dependencies '
        f'({staged.total_bytes / 1e6:.1f} MB) to the executors from the '
        f'driver ({server.endpoint}): {", ".join(staged.names())}')

  def close() -> None:
    server.unregister(token)
    shutil.rmtree(scratch, ignore_errors=True)

  return Shipment(
      ShippedDependencies(
          staged, {f.name: path for f, path in files},
          worker_artifacts.ArtifactSource(server.endpoint, token,
                                          frozenset(harness_paths))),
      close)


# A fixed port for the driver's artifact server (0: a free one).
ARTIFACT_PORT_CONF = 'spark.beam.artifactServer.port'


def _driver_address(sc) -> tuple[str, str, int]:
  """(where the artifact server listens, the address executors use, its
  port): loopback on a local master, else where Spark's driver does
  (spark.driver.bindAddress, spark.driver.host)."""
  conf = sc.getConf()
  port = int(conf.get(ARTIFACT_PORT_CONF, '0') or 0)
  if sc.master.startswith('local'):
    return '127.0.0.1', '127.0.0.1', port
  advertised = conf.get('spark.driver.host', None) or socket.getfqdn()
  return (conf.get('spark.driver.bindAddress', None) or advertised,
          advertised, port)


def _environments(plan: ExecutionPlan):
  """The job's transforms' environments (the expansion service's, say,
  besides the pipeline's own): (id, environment)."""
  components = beam_runner_api_pb2.Components.FromString(plan.components)
  return [(env_id, components.environments[env_id]) for env_id in sorted({
      t.environment_id for t in components.transforms.values()
      if t.environment_id in components.environments})]


def harness_artifacts(plan: ExecutionPlan) -> list[str]:
  """Driver paths of every FILE artifact of the job's environments: what
  a PROCESS harness (another SDK's boot) may ask the Fn API for."""
  paths = []
  for _, env in _environments(plan):
    for artifact in env.dependencies:
      if artifact.type_urn == _ARTIFACT_TYPES.FILE.urn:
        paths.append(beam_runner_api_pb2.ArtifactFilePayload.FromString(
            artifact.type_payload).path)
  return sorted(set(paths))


def collect_dependencies(
    plan: ExecutionPlan, scratch: str,
    log: Callable[[str], None] = lambda text: None
) -> list[tuple[worker_deps.StagedFile, str]]:
  """The Python environments' files: (staged file, its path on the
  driver). URLs and embedded data are written under ``scratch``.

  Every environment a stage runs in shares the executors' Python: their
  dependencies are installed together, and two different files under one
  name are an error. Another SDK's harness gets its environment's
  artifacts itself, over the Fn API's artifact retrieval (boot/), and so
  does a Python harness of another Beam version (LOOPBACK's, the client's
  own; boot.python's): its files are not for the executors' Beam (a saved
  main session of 2.61 needs dill; a requirements file may pin its Beam).
  """
  found: dict[str, tuple[worker_deps.StagedFile, str]] = {}
  origins: dict[str, str] = {}
  for env_id, env in _environments(plan):
    if sdk_of(env) != 'python':
      continue
    version = versions.environment_version(env)
    if version and not versions.same_minor(version):
      log(f'Environment {env_id!r} is Beam {version}: its harness, not the '
          f'executors\' Beam {versions.OURS}, installs its files')
      continue
    for artifact in _python_dependencies(env):
      name, is_requirements = staged_name(artifact)
      if name is None:
        log(f'Environment {env_id!r}: ignoring an artifact with role '
            f'{artifact.role_urn!r}')
        continue
      reason = worker_deps.skip_reason(name)
      if reason is not None:
        log(f'Not shipping {name!r} to executors: {reason}')
        continue
      path, sha256, size = locate_artifact(
          artifact, f'{name!r} of environment {env_id!r}', scratch)
      previous = found.get(name)
      if previous is not None and previous[0].sha256 != sha256:
        raise PipelineExecutionError(
            f'Environments {origins[name]!r} and {env_id!r} both stage a '
            f'different {name!r}; executors share one Python, so their '
            'dependencies must agree.')
      found[name] = (worker_deps.StagedFile(name, sha256, size,
                                            is_requirements), path)
      origins[name] = env_id
  return [found[name] for name in sorted(found)]
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


def locate_artifact(
    artifact: beam_runner_api_pb2.ArtifactInformation, what: str,
    scratch: str) -> tuple[str, str, int]:
  """(path on the driver, sha256, size) of an artifact, never read whole:
  a FILE where it is (its digest from its payload, as staging recorded
  it, else computed), a URL downloaded into ``scratch``, embedded data
  written there.

  Raises PipelineExecutionError naming the artifact and where it was
  looked for.
  """
  urn = artifact.type_urn
  try:
    if urn == _ARTIFACT_TYPES.FILE.urn:
      payload = beam_runner_api_pb2.ArtifactFilePayload.FromString(
          artifact.type_payload)
      size = os.stat(payload.path).st_size
      if payload.sha256:
        return payload.path, payload.sha256.lower(), size
      with open(payload.path, 'rb') as f:
        return payload.path, _copy(f, None), size
    if urn == _ARTIFACT_TYPES.URL.urn:
      url = beam_runner_api_pb2.ArtifactUrlPayload.FromString(
          artifact.type_payload).url
      path = _scratch_file(scratch)
      with open_url(url) as f, open(path, 'wb') as out:
        digest = _copy(f, out)
      return path, digest, os.stat(path).st_size
    if urn == _ARTIFACT_TYPES.EMBEDDED.urn:
      data = beam_runner_api_pb2.EmbeddedFilePayload.FromString(
          artifact.type_payload).data
      path = _scratch_file(scratch)
      with open(path, 'wb') as out:
        out.write(data)
      return path, hashlib.sha256(data).hexdigest(), len(data)
  except Exception as exn:  # pylint: disable=broad-except
    # OSError, urllib's errors, Beam's BeamIOError: all mean unreadable.
    raise PipelineExecutionError(
        f'Cannot read the staged dependency {what}: {exn}') from exn
  raise PipelineExecutionError(
      f'The staged dependency {what} has type {urn!r}; supported: file, url, '
      'embedded.')


def _scratch_file(scratch: str) -> str:
  fd, path = tempfile.mkstemp(dir=scratch)
  os.close(fd)
  return path


def _copy(source, out) -> str:
  """Reads ``source`` to its end in chunks (into ``out``, if any); its
  sha256."""
  hasher = hashlib.sha256()
  while chunk := source.read(_CHUNK):
    hasher.update(chunk)
    if out is not None:
      out.write(chunk)
  return hasher.hexdigest()
