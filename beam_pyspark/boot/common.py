"""What every SDK's boot needs: its flags, its provision info, its artifacts.

A PROCESS environment's command is started by the runner with the flags of
Beam's container boot programs (``--id``, ``--provision_endpoint``,
``--control_endpoint``, ``--artifact_endpoint``, ``--logging_endpoint``; see
``worker.harnesses.servers.ProcessWorkerHandler``). Beam's boot programs
(``sdks/*/container/boot.go``) then ask the provision service for the job's
options and the environment's dependencies, retrieve the dependencies over
the artifact retrieval service, and start the SDK's harness. This module
does the first two parts for every SDK; ``boot.<sdk>`` starts the harness.

Retrieved files are kept in a cache of the host's, named by their sha256
where the artifact gives one (Java's PortableRunner stages a pipeline's whole
classpath: hundreds of MB that every harness of every job would otherwise
copy again), else in the worker's own directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import re
import tempfile
from typing import Optional
from typing import Sequence

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.portability.api import beam_provision_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

_LOGGER = logging.getLogger('beam_pyspark.boot')

ENV_CACHE_DIR = 'BEAM_PYSPARK_BOOT_CACHE'
_FILE = common_urns.artifact_types.FILE.urn
_STAGING_TO = common_urns.artifact_roles.STAGING_TO.urn
# Artifact messages above gRPC's default 4 MB limit (Beam's own chunks are
# 2 MB, but a retrieval service may send more).
_CHANNEL_OPTIONS = [('grpc.max_receive_message_length', 64 << 20)]
_SAFE_NAME = re.compile(r'[^A-Za-z0-9._+-]')


class BootError(RuntimeError):
  """The harness cannot be started; the message says why and what to do."""


@dataclasses.dataclass
class RetrievedArtifact:
  """One of the environment's dependencies, now a local file."""
  path: str
  name: str  # the staged name (or a name made from the artifact)
  info: beam_runner_api_pb2.ArtifactInformation

  @property
  def role_urn(self) -> str:
    return self.info.role_urn


@dataclasses.dataclass
class BootContext:
  """What an SDK's boot starts its harness with."""
  worker_id: str
  provision_endpoint: str
  control_endpoint: str
  artifact_endpoint: str
  logging_endpoint: str
  semi_persist_dir: str
  info: beam_provision_api_pb2.ProvisionInfo
  artifacts: list[RetrievedArtifact]
  # Arguments after the boot's own flags (an SDK's boot may take some).
  extra: list[str]

  def descriptor_text(self, url: str) -> str:
    """An ApiServiceDescriptor in text format (what Beam's harnesses read
    from CONTROL_API_SERVICE_DESCRIPTOR and LOGGING_API_SERVICE_DESCRIPTOR)."""
    return f'url: "{url}"\n'

  def fn_api_env(self) -> dict:
    """The Fn API endpoints and runner capabilities every SDK's harness
    reads from its environment; STATUS_API_SERVICE_DESCRIPTOR None where
    the runner serves no status endpoint (to be left unset)."""
    status = self.info.status_endpoint.url
    return {
        'CONTROL_API_SERVICE_DESCRIPTOR': self.descriptor_text(
            self.control_endpoint),
        'LOGGING_API_SERVICE_DESCRIPTOR': self.descriptor_text(
            self.logging_endpoint),
        'RUNNER_CAPABILITIES': ' '.join(self.info.runner_capabilities),
        'STATUS_API_SERVICE_DESCRIPTOR': (
            self.descriptor_text(status) if status else None),
    }

  def options_json(self) -> str:
    """The job's pipeline options as JSON (PIPELINE_OPTIONS)."""
    from google.protobuf import json_format  # pylint: disable=import-outside-toplevel
    return json_format.MessageToJson(self.info.pipeline_options)

  def with_role(self, role_urn: str) -> list[RetrievedArtifact]:
    return [a for a in self.artifacts if a.role_urn == role_urn]


def parse_flags(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog='python -m beam_pyspark.boot <sdk>',
      description='Starts an SDK harness for a PROCESS environment.')
  p.add_argument('--id', default=os.environ.get('WORKER_ID', ''))
  p.add_argument('--provision_endpoint', default='')
  p.add_argument('--control_endpoint', default='')
  p.add_argument('--artifact_endpoint', default='')
  p.add_argument('--logging_endpoint', default='')
  p.add_argument('--status_endpoint', default='')
  p.add_argument('--semi_persist_dir', default='')
  return p.parse_known_args(list(argv))


def boot_context(argv: Sequence[str]) -> BootContext:
  """Reads the flags, the provision info and the artifacts."""
  flags, extra = parse_flags(argv)
  if not flags.provision_endpoint:
    raise BootError(
        'No --provision_endpoint: this program is started by the runner for a '
        'PROCESS environment (--environment_config={"command": "python -m '
        'beam_pyspark.boot <sdk>"}), which passes it.')
  if not flags.id:
    raise BootError('No --id (the worker id the runner passes).')
  info = provision_info(flags.provision_endpoint, flags.id)
  control = flags.control_endpoint or info.control_endpoint.url
  logging_ep = flags.logging_endpoint or info.logging_endpoint.url
  artifact = flags.artifact_endpoint or info.artifact_endpoint.url
  semi = flags.semi_persist_dir or tempfile.mkdtemp(
      prefix=f'beam-boot-{_SAFE_NAME.sub("_", flags.id)}-')
  os.makedirs(semi, exist_ok=True)
  artifacts = retrieve(artifact, flags.id, list(info.dependencies),
                       os.path.join(semi, 'staged'))
  return BootContext(
      worker_id=flags.id, provision_endpoint=flags.provision_endpoint,
      control_endpoint=control, artifact_endpoint=artifact,
      logging_endpoint=logging_ep, semi_persist_dir=semi, info=info,
      artifacts=artifacts, extra=extra)


def provision_info(endpoint: str, worker_id: str
                   ) -> beam_provision_api_pb2.ProvisionInfo:
  with grpc.insecure_channel(endpoint) as channel:
    stub = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel)
    try:
      response = stub.GetProvisionInfo(
          beam_provision_api_pb2.GetProvisionInfoRequest(),
          metadata=[('worker_id', worker_id)], timeout=60)
    except grpc.RpcError as exn:
      raise BootError(
          f'The provision service at {endpoint} did not answer: '
          f'{exn.code().name}: {exn.details()}') from exn
  return response.info


def retrieve(endpoint: str, worker_id: str,
             dependencies: list[beam_runner_api_pb2.ArtifactInformation],
             dest: str) -> list[RetrievedArtifact]:
  """Resolves and fetches ``dependencies`` into local files, in order."""
  if not dependencies:
    return []
  os.makedirs(dest, exist_ok=True)
  metadata = [('worker_id', worker_id)]
  with grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS) as channel:
    stub = beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceStub(channel)
    try:
      resolved = stub.ResolveArtifacts(
          beam_artifact_api_pb2.ResolveArtifactsRequest(
              artifacts=dependencies), metadata=metadata, timeout=120)
    except grpc.RpcError as exn:
      raise BootError(
          f'The artifact service at {endpoint} did not resolve the '
          f'environment\'s {len(dependencies)} artifacts: '
          f'{exn.code().name}: {exn.details()}') from exn
    out = []
    used: set[str] = set()
    for index, artifact in enumerate(resolved.replacements):
      name = _unique(staged_name(artifact, index), used)
      out.append(RetrievedArtifact(
          _fetch(stub, metadata, artifact, os.path.join(dest, name)), name,
          artifact))
  return out


def staged_name(artifact: beam_runner_api_pb2.ArtifactInformation,
                index: int) -> str:
  """The file name an artifact is retrieved to: its staged name, else the
  base name of its path or URL, else its position."""
  name = ''
  if artifact.role_urn == _STAGING_TO:
    name = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(
        artifact.role_payload).staged_name
  if not name and artifact.type_urn == _FILE:
    name = os.path.basename(beam_runner_api_pb2.ArtifactFilePayload.FromString(
        artifact.type_payload).path)
  if not name and artifact.type_urn == common_urns.artifact_types.URL.urn:
    name = beam_runner_api_pb2.ArtifactUrlPayload.FromString(
        artifact.type_payload).url.rstrip('/').rsplit('/', 1)[-1]
  name = _SAFE_NAME.sub('_', os.path.basename(name)).lstrip('.')
  return name or f'artifact-{index}'


def _unique(name: str, used: set[str]) -> str:
  base, n = name, 1
  while name in used:
    stem, dot, ext = base.partition('.')
    name = f'{stem}-{n}{dot}{ext}'
    n += 1
  used.add(name)
  return name


def _sha256_of(artifact) -> str:
  if artifact.type_urn == _FILE:
    return beam_runner_api_pb2.ArtifactFilePayload.FromString(
        artifact.type_payload).sha256
  return ''


def cache_dir() -> str:
  return os.environ.get(ENV_CACHE_DIR) or os.path.join(
      tempfile.gettempdir(), f'beam-pyspark-boot-{os.getuid()}')


def _fetch(stub, metadata, artifact, path: str) -> str:
  """Writes ``artifact`` to ``path`` (or links it from the host's cache when
  its sha256 is known and cached); returns the path."""
  sha = _sha256_of(artifact)
  cached = None
  if sha:
    cached = os.path.join(cache_dir(), sha[:2], sha)
    if os.path.exists(cached):
      _link(cached, path)
      return path
  tmp = path + '.part'
  digest = hashlib.sha256()
  try:
    with open(tmp, 'wb') as f:
      for chunk in stub.GetArtifact(
          beam_artifact_api_pb2.GetArtifactRequest(artifact=artifact),
          metadata=metadata, timeout=600):
        f.write(chunk.data)
        digest.update(chunk.data)
  except grpc.RpcError as exn:
    raise BootError(
        f'Retrieving {os.path.basename(path)!r} failed: {exn.code().name}: '
        f'{exn.details()}') from exn
  if sha and digest.hexdigest() != sha:
    os.unlink(tmp)
    raise BootError(
        f'{os.path.basename(path)!r} arrived with sha256 {digest.hexdigest()}'
        f', but its artifact says {sha}.')
  if cached is not None:
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
      os.replace(tmp, cached)  # atomic: a concurrent boot sees all or none
    except OSError:
      os.replace(tmp, path)
      return path
    _link(cached, path)
  else:
    os.replace(tmp, path)
  return path


def _link(source: str, path: str) -> None:
  try:
    if os.path.lexists(path):
      os.unlink(path)
    os.link(source, path)
  except OSError:
    os.symlink(source, path)


def exec_harness(argv: list[str], env: Optional[dict] = None) -> None:
  """Replaces this process with the harness (the runner watches our pid:
  the harness's exit status is ours)."""
  _LOGGER.info('Starting the SDK harness: %s', ' '.join(argv))
  try:
    os.execvpe(argv[0], argv, env if env is not None else dict(os.environ))
  except OSError as exn:
    raise BootError(f'Could not start {argv[0]!r}: {exn}') from exn
