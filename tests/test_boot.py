"""The boot programs' common part: flags, provision info, artifacts.

Over real gRPC: Beam's own artifact retrieval service serves the files; the
provision service is a one-method stand-in that checks the worker id, as
the runner's does (the SDKs' boots are tested end to end with their
pipelines, tests/test_sdk_*.py).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os

import grpc
import pytest
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.portability.api import beam_provision_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability import artifact_service

from beam_pyspark.boot import common


class _Provision(beam_provision_api_pb2_grpc.ProvisionServiceServicer):
  def __init__(self, info):
    self.info = info
    self.worker_ids = []

  def GetProvisionInfo(self, request, context):
    self.worker_ids.append(dict(context.invocation_metadata())['worker_id'])
    return beam_provision_api_pb2.GetProvisionInfoResponse(info=self.info)


def _file(path, staged_name=None, sha=True):
  data = open(path, 'rb').read()
  artifact = beam_runner_api_pb2.ArtifactInformation(
      type_urn=common_urns.artifact_types.FILE.urn,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path=str(path),
          sha256=hashlib.sha256(data).hexdigest() if sha else '')
      .SerializeToString())
  if staged_name:
    artifact.role_urn = common_urns.artifact_roles.STAGING_TO.urn
    artifact.role_payload = beam_runner_api_pb2.ArtifactStagingToRolePayload(
        staged_name=staged_name).SerializeToString()
  return artifact


@pytest.fixture
def server(tmp_path, monkeypatch):
  monkeypatch.setenv(common.ENV_CACHE_DIR, str(tmp_path / 'cache'))
  grpc_server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
  provision = _Provision(beam_provision_api_pb2.ProvisionInfo())
  beam_provision_api_pb2_grpc.add_ProvisionServiceServicer_to_server(
      provision, grpc_server)
  beam_artifact_api_pb2_grpc.add_ArtifactRetrievalServiceServicer_to_server(
      artifact_service.ArtifactRetrievalService(
          file_reader=lambda p: open(p, 'rb'), chunk_size=1000), grpc_server)
  port = grpc_server.add_insecure_port('127.0.0.1:0')
  grpc_server.start()
  yield provision, f'127.0.0.1:{port}'
  grpc_server.stop(0)


def test_boot_context_retrieves_the_environments_artifacts(tmp_path, server):
  provision, endpoint = server
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'a.jar').write_bytes(os.urandom(5000))
  (src / 'b.bin').write_bytes(b'b' * 10)
  (src / 'dup.jar').write_bytes(b'other')
  provision.info.pipeline_options.update({'beam:option:job_name:v1': 'j'})
  provision.info.dependencies.extend([
      _file(src / 'a.jar', 'lib/a.jar'),
      _file(src / 'b.bin', sha=False),
      _file(src / 'dup.jar', 'a.jar'),
  ])
  semi = tmp_path / 'semi'
  ctx = common.boot_context([
      '--id=worker_7', f'--provision_endpoint={endpoint}',
      f'--artifact_endpoint={endpoint}', '--control_endpoint=c:1',
      '--logging_endpoint=l:2', f'--semi_persist_dir={semi}', '--extra=1'])
  assert provision.worker_ids == ['worker_7']
  assert ctx.control_endpoint == 'c:1' and ctx.logging_endpoint == 'l:2'
  assert ctx.extra == ['--extra=1']
  assert '"beam:option:job_name:v1": "j"' in ctx.options_json()
  # Staged names, made safe and unique, in the environment's order.
  assert [a.name for a in ctx.artifacts] == ['a.jar', 'b.bin', 'a-1.jar']
  for artifact, source in zip(ctx.artifacts, ['a.jar', 'b.bin', 'dup.jar']):
    assert os.path.dirname(artifact.path) == str(semi / 'staged')
    assert open(artifact.path, 'rb').read() == (src / source).read_bytes()
  # A file with a sha256 is kept in the host's cache: a second worker
  # links it from there (here: the source is gone, and it still boots).
  (src / 'a.jar').write_bytes(b'changed')
  ctx2 = common.boot_context([
      '--id=worker_8', f'--provision_endpoint={endpoint}',
      f'--artifact_endpoint={endpoint}',
      f'--semi_persist_dir={tmp_path / "semi2"}'])
  assert open(ctx2.artifacts[0].path, 'rb').read() == open(
      ctx.artifacts[0].path, 'rb').read() != b'changed'


def test_a_corrupted_artifact_is_refused(tmp_path, server):
  provision, endpoint = server
  src = tmp_path / 'x.jar'
  src.write_bytes(b'good')
  artifact = _file(src, 'x.jar')
  src.write_bytes(b'evil')  # changed after its sha256 was taken
  provision.info.dependencies.append(artifact)
  with pytest.raises(common.BootError, match='sha256'):
    common.boot_context([
        '--id=w', f'--provision_endpoint={endpoint}',
        f'--artifact_endpoint={endpoint}',
        f'--semi_persist_dir={tmp_path / "semi"}'])


def test_missing_flags_and_an_absent_provision_service_are_clear(tmp_path):
  with pytest.raises(common.BootError, match='PROCESS environment'):
    common.boot_context(['--id=w'])
  with pytest.raises(common.BootError, match='provision service at'):
    common.boot_context(['--id=w', '--provision_endpoint=127.0.0.1:1'])
