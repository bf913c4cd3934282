"""Staging asks only for content the store does not hold (issue 43).

A FILE artifact whose payload declares its sha256 (Java's and Python's
stagers fill it in) is not fetched when the store already holds that
content: a Java job stages its whole classpath, the same jars job after
job. Over real gRPC with Beam's own client, as in tests/test_artifacts.py;
the end-to-end check with Java's PortableRunner is in tests/test_sdk_java.py.
"""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability import artifact_service as beam_artifacts

from beam_pyspark.artifacts import ArtifactStagingError
from beam_pyspark.artifacts import protocol as staging_protocol
from test_artifacts import file_artifact
from test_artifacts import file_path
from test_artifacts import listing
from test_artifacts import servers  # pylint: disable=unused-import
from test_artifacts import write_file


class CountingClient(beam_artifacts.ArtifactRetrievalService):
  """Beam's client side, counting the files the server asks for."""
  def __init__(self):
    super().__init__(file_reader=lambda path: open(path, 'rb'),
                     chunk_size=64 << 10)
    self.asked: list[str] = []

  def GetArtifact(self, request, context=None):
    self.asked.append(beam_runner_api_pb2.ArtifactFilePayload.FromString(
        request.artifact.type_payload).path)
    return super().GetArtifact(request, context)


def offer(server, token: str) -> list[str]:
  client = CountingClient()
  beam_artifacts.offer_artifacts(server.staging_stub, client, token)
  return client.asked


def test_a_file_the_store_holds_by_its_sha256_is_not_asked_for(
    tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  jar = os.urandom(200_000)
  first = write_file(src / 'harness.jar', jar)
  # Another job, another path, the same content: still not fetched.
  second = write_file(src / 'copy-of-harness.jar', jar)
  own = write_file(src / 'pipeline.jar', b'job b only')
  server = servers(tmp_path / 'staged')
  server.staging.register_job(
      'job-a', {'env': [file_artifact(first, 'harness.jar')]})
  server.staging.register_job('job-b', {
      'env': [file_artifact(second, 'harness.jar'),
              file_artifact(own, 'pipeline.jar')]})

  assert offer(server, 'job-a') == [first]
  assert offer(server, 'job-b') == [own]

  [a] = server.staging.resolved_artifacts('job-a')['env']
  b_jar, b_own = server.staging.resolved_artifacts('job-b')['env']
  assert file_path(b_jar) == file_path(a)
  # The role (the staged name the harness sees) is the job's own.
  assert b_jar.role_payload == file_artifact(second, 'harness.jar').role_payload
  assert server.read(b_jar) == jar and server.read(b_own) == b'job b only'

  # Reference counting counts the reuse: dropping the job that fetched the
  # file keeps it for the job that reused it, dropping both deletes it.
  server.staging.remove_job('job-a')
  assert server.read(b_jar) == jar
  server.staging.remove_job('job-b')
  assert listing(server.staging.root) == []


def test_content_dropped_from_the_store_is_fetched_again(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  jar = write_file(src / 'a.jar', os.urandom(50_000))
  server = servers(tmp_path / 'staged')
  server.staging.register_job('one', {'env': [file_artifact(jar, 'a.jar')]})
  server.staging.register_job('two', {'env': [file_artifact(jar, 'a.jar')]})
  assert offer(server, 'one') == [jar]
  server.staging.remove_job('one')
  assert listing(server.staging.root) == []
  assert offer(server, 'two') == [jar]
  [two] = server.staging.resolved_artifacts('two')['env']
  assert os.path.exists(file_path(two))


def test_bytes_that_do_not_match_their_declared_sha256_fail_staging(
    tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  path = write_file(src / 'lib.jar', b'what the client declared')
  artifact = file_artifact(path, 'lib.jar')
  write_file(src / 'lib.jar', b'what it sent: the file changed')
  server = servers(tmp_path / 'staged')
  server.staging.register_job('job', {'env': [artifact]})
  with pytest.raises(grpc.RpcError) as failure:
    offer(server, 'job')
  assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  declared = hashlib.sha256(b'what the client declared').hexdigest()
  sent = hashlib.sha256(b'what it sent: the file changed').hexdigest()
  message = failure.value.details()
  assert f"'lib.jar' (environment 'env') declares sha256 {declared}" in message
  assert f'have sha256 {sent}' in message and 'submit the job again' in message
  with pytest.raises(ArtifactStagingError, match=declared):
    server.staging.wait_staged('job', timeout=10)
  # Nothing of it stays in the store: a later job declaring either hash
  # sends its bytes.
  assert listing(server.staging.root) == []


def test_protocol_reuses_what_the_store_claims():
  jar = beam_runner_api_pb2.ArtifactInformation(
      type_urn=staging_protocol.FILE_URN,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path='/a.jar', sha256='AB' * 32).SerializeToString())
  undeclared = beam_runner_api_pb2.ArtifactInformation(
      type_urn=staging_protocol.FILE_URN,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path='/b.jar').SerializeToString())
  asked = []

  def reuse(digest):
    asked.append(digest)
    return True

  proto = staging_protocol.StagingProtocol(
      'tok', {'env': [jar, undeclared]}, reuse=reuse)
  proto.start()
  out = proto.receive(beam_artifact_api_pb2.ArtifactResponseWrapper(
      resolve_artifact_response=beam_artifact_api_pb2.ResolveArtifactsResponse(
          replacements=[jar, undeclared])))
  # The declared hash is compared in lower case; the artifact without one
  # is fetched.
  assert asked == ['ab' * 32]
  assert out[0] == staging_protocol.ReuseStored('env', 0, jar, 'ab' * 32)
  assert out[1].request.get_artifact.artifact == undeclared
  assert len(out) == 2


def test_reuse_across_a_restart_keeps_reference_counts(tmp_path, servers):
  """A job that reused a file records it in its manifest; after a restart
  the recovered file is reused again, and held until its last job goes."""
  src = tmp_path / 'client'
  src.mkdir()
  jar = os.urandom(100_000)
  path = write_file(src / 'lib.jar', jar)
  root, manifests = tmp_path / 'staged', tmp_path / 'manifests'
  first = servers(root, manifest_dir=str(manifests))
  for token in ('fetched', 'reused'):
    first.staging.register_job(token, {'env': [file_artifact(path, 'l.jar')]})
  assert offer(first, 'fetched') == [path]
  assert offer(first, 'reused') == []
  first.stop()

  second = servers(root, manifest_dir=str(manifests))
  # 'fetched' left the job history while the server was down.
  recovery = second.staging.recover(['reused'])
  assert recovery.kept_jobs == ['reused'] and recovery.deleted_files == []
  second.staging.register_job('later', {'env': [file_artifact(path, 'l.jar')]})
  assert offer(second, 'later') == []
  second.staging.remove_job('reused')
  [later] = second.staging.resolved_artifacts('later')['env']
  assert second.read(later) == jar
  second.staging.remove_job('later')
  assert listing(root) == []
