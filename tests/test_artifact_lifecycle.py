"""Staged artifacts across job-server restarts, and URL artifacts.

Real job-server subprocesses, real gRPC, Beam's own client code for staging
(``offer_artifacts``) and for fetching as a worker does (``store_artifact``).

The rule for staged files: they live as long as their job's history entry.
A restarted server keeps the files of the jobs its job store still lists,
removes them when it drops those entries later, and deletes at start-up
every other file an earlier process left in its artifacts root.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import pathlib
import queue
import sqlite3
import threading
import time

import grpc
import pytest

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability import artifact_service as beam_artifacts

from jobserver_process import JobServerProcess
from jobserver_process import file_dependency
from jobserver_process import pipeline_with_dependencies
from jobserver_process import url_dependency


def sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def write(path, data: bytes) -> str:
  pathlib.Path(path).write_bytes(data)
  return str(path)


def prepare(server, name, artifacts):
  return server.job_stub.Prepare(
      beam_job_api_pb2.PrepareJobRequest(
          job_name=name, pipeline=pipeline_with_dependencies(artifacts)))


def offer(server, prepared):
  """Stages as Beam's PortableRunner does."""
  beam_artifacts.offer_artifacts(
      server.staging_stub,
      beam_artifacts.ArtifactRetrievalService(
          beam_artifacts.BeamFilesystemHandler(None).file_reader),
      prepared.staging_session_token)


def cancel(server, prepared):
  server.job_stub.Cancel(
      beam_job_api_pb2.CancelJobRequest(job_id=prepared.preparation_id))


def listing(path) -> list[str]:
  return sorted(os.listdir(path))


def fetch(server, artifact) -> bytes:
  return b''.join(
      r.data for r in server.retrieval_stub.GetArtifact(
          beam_artifact_api_pb2.GetArtifactRequest(artifact=artifact)))


def stored_file(path) -> beam_runner_api_pb2.ArtifactInformation:
  return beam_runner_api_pb2.ArtifactInformation(
      type_urn=common_urns.artifact_types.FILE.urn,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path=str(path)).SerializeToString())


def wait_for(condition, timeout=30.0, what='condition'):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return
    time.sleep(0.05)
  raise AssertionError(f'timed out waiting for {what}')


class HalfwayClient:
  """Answers a staging stream, then stops sending midway through a file."""
  def __init__(self, server, token: str):
    self._outgoing: queue.Queue = queue.Queue()
    self._outgoing.put(
        beam_artifact_api_pb2.ArtifactResponseWrapper(staging_token=token))
    self.requests = server.staging_stub.ReverseArtifactRetrievalService(
        iter(self._outgoing.get, None))

  def send_part(self, chunks: int, chunk: bytes) -> None:
    resolve = next(self.requests).resolve_artifact
    self._outgoing.put(
        beam_artifact_api_pb2.ArtifactResponseWrapper(
            resolve_artifact_response=beam_artifact_api_pb2.
            ResolveArtifactsResponse(replacements=resolve.artifacts)))
    assert next(self.requests).HasField('get_artifact')
    for _ in range(chunks):
      self._outgoing.put(
          beam_artifact_api_pb2.ArtifactResponseWrapper(
              get_artifact_response=beam_artifact_api_pb2.GetArtifactResponse(
                  data=chunk)))

  def close(self) -> None:
    self._outgoing.put(None)
    self.requests.cancel()


# -- Restart ------------------------------------------------------------------


def test_restart_keeps_retained_jobs_files_and_deletes_the_rest(tmp_path):
  src = tmp_path / 'client'
  src.mkdir()
  shared, own1, own2 = os.urandom(300_000), b'job one only', b'job two only'
  paths = {
      'shared': write(src / 'shared.whl', shared),
      'own1': write(src / 'one.txt', own1),
      'own2': write(src / 'two.txt', own2),
      'big': write(src / 'big.bin', b'never read'),
  }
  root = tmp_path / 'server'
  staged, manifests = root / 'staged', root / 'staged-jobs'
  names = {
      'shared': f'{sha256(shared)}-shared.whl',
      'own1': f'{sha256(own1)}-one.txt',
      'own2': f'{sha256(own2)}-two.txt',
  }

  first = JobServerProcess(root)
  try:
    job1 = prepare(first, 'one', [
        file_dependency(paths['shared'], 'shared.whl'),
        file_dependency(paths['own1'], 'one.txt')])
    job2 = prepare(first, 'two', [
        file_dependency(paths['shared'], 'shared.whl'),
        file_dependency(paths['own2'], 'two.txt')])
    offer(first, job1)
    offer(first, job2)
    cancel(first, job1)
    cancel(first, job2)
    assert listing(staged) == sorted(names.values())
    assert len(listing(manifests)) == 2
    # A second server on the same directory would delete what the first is
    # receiving: it refuses to start, saying why.
    with pytest.raises(RuntimeError, match='Another job server') as info:
      JobServerProcess(root)
    assert f'pid {first.pid}' in str(info.value)
    assert listing(staged) == sorted(names.values())
    # A third job's upload is cut short by the server dying (SIGKILL: no
    # clean-up runs), leaving a partial file behind.
    job3 = prepare(first, 'three', [file_dependency(paths['big'], 'big.bin')])
    client = HalfwayClient(first, job3.staging_session_token)
    client.send_part(chunks=4, chunk=os.urandom(64 << 10))
    wait_for(
        lambda: any(
            n.startswith('.partial-') and os.path.getsize(staged / n) > 0
            for n in listing(staged)),
        what='a partial upload on disk')
    first.proc.kill()
    first.proc.wait(30)
    client.close()
  finally:
    first.stop()
  assert any(n.startswith('.partial-') for n in listing(staged))
  # Job two's history entry is gone but its files are not: what a crash
  # between the job service dropping the entry (store first) and removing
  # its files leaves. Done here on the store directly, as that window is
  # too small to hit with a signal.
  with sqlite3.connect(root / 'jobs.sqlite') as db:
    db.execute('DELETE FROM jobs WHERE job_id = ?', (job2.preparation_id, ))
    db.execute('DELETE FROM states WHERE job_id = ?', (job2.preparation_id, ))
  # Something that is not ours stays.
  write(staged / 'README-not-ours', b'left alone')

  second = JobServerProcess(root, '--max-invocation-history', '2')
  try:
    # Kept: job one's files, the shared one included; deleted: job two's
    # own file and the partial upload.
    assert listing(staged) == sorted(
        [names['shared'], names['own1'], 'README-not-ours'])
    assert len(listing(manifests)) == 1
    assert fetch(second, stored_file(staged / names['shared'])) == shared
    assert fetch(second, stored_file(staged / names['own1'])) == own1
    jobs = {
        j.job_id for j in second.job_stub.GetJobs(
            beam_job_api_pb2.GetJobsRequest()).job_info
    }
    assert jobs == {job1.preparation_id, job3.preparation_id}

    # Dropping job one's history entry now (history 2: a fourth job
    # finishing pushes one, the oldest, out) removes the files this server
    # recovered for it.
    job4 = prepare(second, 'four', [])
    cancel(second, job4)
    assert listing(staged) == ['README-not-ours']
    assert listing(manifests) == []
    jobs = {
        j.job_id for j in second.job_stub.GetJobs(
            beam_job_api_pb2.GetJobsRequest()).job_info
    }
    assert jobs == {job3.preparation_id, job4.preparation_id}
  finally:
    second.stop()


# -- URL artifacts ------------------------------------------------------------


class _ResolvesTo(beam_artifacts.ArtifactRetrievalService):
  """A staging client that resolves every artifact to ``artifact``."""
  def __init__(self, artifact):
    super().__init__(beam_artifacts.BeamFilesystemHandler(None).file_reader)
    self._artifact = artifact

  def ResolveArtifacts(self, request, context=None):
    return beam_artifact_api_pb2.ResolveArtifactsResponse(
        replacements=[self._artifact for _ in request.artifacts])


@pytest.fixture(scope='module')
def web(tmp_path_factory):
  """A local HTTP server over a directory of files."""
  root = tmp_path_factory.mktemp('web')

  class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
      pass

  httpd = http.server.ThreadingHTTPServer(
      ('127.0.0.1', 0), functools.partial(Quiet, directory=str(root)))
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield root, f'http://127.0.0.1:{httpd.server_address[1]}'
  httpd.shutdown()
  httpd.server_close()


def test_url_artifacts_are_served_to_workers(tmp_path, web):
  web_root, base = web
  remote = os.urandom(5 << 20)  # several 2 MB chunks
  write(web_root / 'remote.whl', remote)
  local = os.urandom(100_000)
  local_path = write(tmp_path / 'local.bin', local)
  plain = b'a plain path is a URL too, to Beam'
  plain_path = write(tmp_path / 'plain.txt', plain)

  good = {
      'http': (url_dependency(f'{base}/remote.whl', sha256(remote)), remote),
      'file': (url_dependency(pathlib.Path(local_path).as_uri()), local),
      'path': (url_dependency(plain_path), plain),
  }
  missing_url = f'{base}/missing.whl'
  refused_url = 'http://127.0.0.1:1/nothing-listens-here.whl'
  tampered_url = f'{base}/remote.whl?tampered'
  bad = {
      'missing': url_dependency(missing_url),
      'refused': url_dependency(refused_url),
      'tampered': url_dependency(tampered_url, sha256(b'something else')),
  }
  # Allowed: the web server, the client's directory, and the port where
  # nothing listens (its error is tested).
  server = JobServerProcess(
      tmp_path / 'server', '--artifact-url-allowlist',
      f'{base}/,{tmp_path.as_uri()}', '--artifact-url-allowlist',
      'http://127.0.0.1:1')
  try:
    prepared = prepare(
        server, 'urls', [a for a, _ in good.values()] + list(bad.values()))
    offer(server, prepared)
    # Kept as URLs: nothing was downloaded at staging.
    assert listing(tmp_path / 'server' / 'staged') == []

    # Fetched as Beam's worker-side code does.
    dest = tmp_path / 'worker'
    dest.mkdir()
    for kind, (artifact, content) in good.items():
      stored = beam_artifacts.store_artifact(
          artifact, server.retrieval_stub, str(dest))
      payload = beam_runner_api_pb2.ArtifactFilePayload.FromString(
          stored.type_payload)
      assert pathlib.Path(payload.path).read_bytes() == content, kind
      assert payload.sha256 == sha256(content), kind

    def error(artifact):
      with pytest.raises(grpc.RpcError) as info:
        fetch(server, artifact)
      return info.value.code(), info.value.details()

    code, details = error(bad['missing'])
    assert code == grpc.StatusCode.NOT_FOUND and missing_url in details
    assert '404' in details
    code, details = error(bad['refused'])
    assert code == grpc.StatusCode.UNAVAILABLE and refused_url in details
    code, details = error(bad['tampered'])
    assert code == grpc.StatusCode.DATA_LOSS and tampered_url in details
    # A URL no staged job depends on is not fetched for whoever asks.
    for url in (f'{base}/remote.whl?other',
                pathlib.Path('/etc/hostname').as_uri()):
      code, details = error(url_dependency(url))
      assert code == grpc.StatusCode.PERMISSION_DENIED and url in details

    # Nor is one outside the allowlist, at Prepare (every one named)...
    outside = ['http://169.254.169.254/latest/meta-data/',
               f'{base}.evil.example/remote.whl', 'file:///etc/passwd',
               f'{tmp_path.as_uri()}/../../etc/passwd']
    with pytest.raises(grpc.RpcError) as info:
      prepare(server, 'outside', [url_dependency(u) for u in outside])
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    for url in outside:
      assert url in info.value.details()
    assert '--artifact-url-allowlist' in info.value.details()
    # ... or at staging, where a client resolves a file to such a URL.
    listed = prepare(server, 'resolved', [file_dependency(local_path, 'x')])
    with pytest.raises(grpc.RpcError) as info:
      beam_artifacts.offer_artifacts(
          server.staging_stub, _ResolvesTo(url_dependency(outside[0])),
          listed.staging_session_token)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert outside[0] in info.value.details()
    assert '--artifact-url-allowlist' in info.value.details()

  finally:
    server.stop()
