"""The driver's artifact server and the executors' side of it
(artifacts.driver, worker.setup.artifacts): real gRPC on loopback, no
Spark. Who may read what (a job's token, its own files only), a file
streamed to disk and checked, and the Fn API's artifact retrieval of a
PROCESS harness reading the job's files from the driver rather than its
own disk."""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.artifacts.driver import TOKEN_HEADER
from beam_pyspark.artifacts.driver import DriverArtifactServer
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.worker.setup import artifacts
from beam_pyspark.worker.setup.dependencies import StagedFile


@pytest.fixture(scope='module')
def server():
  server = DriverArtifactServer('127.0.0.1', '127.0.0.1')
  yield server
  server.stop()


def _file(tmp_path, name, size):
  path = tmp_path / name
  data = os.urandom(size)
  path.write_bytes(data)
  return str(path), StagedFile(name, hashlib.sha256(data).hexdigest(), size)


def _get(server, path, token):
  channel = grpc.insecure_channel(server.endpoint)
  try:
    stub = beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceStub(channel)
    return b''.join(r.data for r in stub.GetArtifact(
        beam_artifact_api_pb2.GetArtifactRequest(
            artifact=beam_runner_api_pb2.ArtifactInformation(
                type_urn=common_urns.artifact_types.FILE.urn,
                type_payload=beam_runner_api_pb2.ArtifactFilePayload(
                    path=path).SerializeToString())),
        metadata=((TOKEN_HEADER, token),)))
  finally:
    channel.close()


def test_a_job_reads_its_own_files_only(server, tmp_path):
  mine, _ = _file(tmp_path, 'mine.whl', 1000)
  theirs, _ = _file(tmp_path, 'theirs.whl', 1000)
  token = server.register([mine])
  other = server.register([theirs])
  assert _get(server, mine, token) == open(mine, 'rb').read()
  for path, key in ((theirs, token), (mine, other), (mine, ''),
                    ('/etc/passwd', token),
                    (str(tmp_path / '..' / tmp_path.name / 'theirs.whl'),
                     token)):
    with pytest.raises(grpc.RpcError) as info:
      _get(server, path, key)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
  # Once its job ends, nothing of it is served.
  server.unregister(token)
  with pytest.raises(grpc.RpcError):
    _get(server, mine, token)
  server.unregister(other)


def test_a_file_is_streamed_to_disk_and_checked(server, tmp_path):
  path, staged = _file(tmp_path, 'dep.whl', (5 << 20) + 17)  # 3 chunks
  source = artifacts.ArtifactSource(server.endpoint, server.register([path]))
  fetch = source.fetcher({'dep.whl': path})
  dest = tmp_path / 'executor'
  dest.mkdir()
  fetch(staged, str(dest / 'dep.whl'))
  assert (dest / 'dep.whl').read_bytes() == open(path, 'rb').read()
  # A file that is not what the job staged is refused, and not left.
  wrong = StagedFile('dep.whl', '0' * 64, staged.size)
  with pytest.raises(PipelineExecutionError, match='intact'):
    fetch(wrong, str(dest / 'again.whl'))
  assert sorted(os.listdir(dest)) == ['dep.whl']
  # A token the driver does not know: an error naming the file.
  stranger = artifacts.ArtifactSource(server.endpoint, 'nope')
  with pytest.raises(PipelineExecutionError, match="'dep.whl'.*PERMISSION"):
    stranger.fetcher({'dep.whl': path})(staged, str(dest / 'x.whl'))


def test_the_fn_apis_retrieval_reads_a_jobs_files_from_the_driver(
    server, tmp_path):
  path, _ = _file(tmp_path, 'app.jar', (2 << 20) + 5)
  token = server.register([path])
  artifacts.register('job-1', artifacts.ArtifactSource(
      server.endpoint, token, frozenset([path])))

  def local_disk(_):
    raise AssertionError('read from this host, not from the driver')

  with artifacts.reader('job-1', local_disk)(path) as f:
    assert f.read() == open(path, 'rb').read()
  # Paths the job's source does not serve (a URL, a file of this host)
  # go to Beam's own reader.
  seen = []
  artifacts.reader('job-1', seen.append)('/opt/harness/other.jar')
  artifacts.reader('another-job', seen.append)(path)
  assert seen == ['/opt/harness/other.jar', path]
  server.unregister(token)
