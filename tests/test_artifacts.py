"""Artifact staging and retrieval, over real gRPC, driven by Beam's client.

The client side is Beam's own: ``offer_artifacts`` with its client-side
``ArtifactRetrievalService``, exactly what Beam's PortableRunner runs.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
import time
from concurrent import futures

import grpc
import pytest

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability import artifact_service as beam_artifacts

from beam_pyspark.artifacts import ArtifactRetrievalService
from beam_pyspark.artifacts import ArtifactServiceError
from beam_pyspark.artifacts import ArtifactStagingError
from beam_pyspark.artifacts import ArtifactStagingService
from beam_pyspark.artifacts import UnknownStagingTokenError
from beam_pyspark.artifacts import protocol as staging_module
from beam_pyspark.artifacts.store import MAX_HINT_CHARS
from beam_pyspark.artifacts.store import safe_hint

FILE = common_urns.artifact_types.FILE.urn
URL = common_urns.artifact_types.URL.urn
EMBEDDED = common_urns.artifact_types.EMBEDDED.urn
STAGING_TO = common_urns.artifact_roles.STAGING_TO.urn

# -- Helpers ------------------------------------------------------------------


class ArtifactServer:
  """Our staging and retrieval services on one real gRPC server."""
  def __init__(self, root: str, **staging_args):
    self.staging = ArtifactStagingService(root, **staging_args)
    self.retrieval = ArtifactRetrievalService(root, chunk_size=64 << 10)
    self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    beam_artifact_api_pb2_grpc.add_ArtifactStagingServiceServicer_to_server(
        self.staging, self.server)
    beam_artifact_api_pb2_grpc.add_ArtifactRetrievalServiceServicer_to_server(
        self.retrieval, self.server)
    port = self.server.add_insecure_port('localhost:0')
    self.server.start()
    self.channel = grpc.insecure_channel(f'localhost:{port}')
    self.staging_stub = beam_artifact_api_pb2_grpc.ArtifactStagingServiceStub(
        self.channel)
    self.retrieval_stub = (
        beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceStub(self.channel))

  def offer(self, token: str, chunk_size: int = 64 << 10) -> None:
    """Stages as Beam's PortableRunner does."""
    beam_artifacts.offer_artifacts(
        self.staging_stub,
        beam_artifacts.ArtifactRetrievalService(
            file_reader=lambda path: open(path, 'rb'), chunk_size=chunk_size),
        token)

  def read(self, artifact) -> bytes:
    return b''.join(
        r.data for r in self.retrieval_stub.GetArtifact(
            beam_artifact_api_pb2.GetArtifactRequest(artifact=artifact)))

  def stop(self) -> None:
    self.channel.close()
    self.server.stop(None)
    self.staging.close()


@pytest.fixture
def servers():
  started = []

  def start(root, **staging_args) -> ArtifactServer:
    server = ArtifactServer(str(root), **staging_args)
    started.append(server)
    return server

  yield start
  for server in started:
    server.stop()


def write_file(path, data: bytes) -> str:
  with open(path, 'wb') as f:
    f.write(data)
  return str(path)


def file_artifact(path: str, staged_name: str):
  with open(path, 'rb') as f:
    sha = hashlib.sha256(f.read()).hexdigest()
  return beam_runner_api_pb2.ArtifactInformation(
      type_urn=FILE,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path=path, sha256=sha).SerializeToString(),
      role_urn=STAGING_TO,
      role_payload=beam_runner_api_pb2.ArtifactStagingToRolePayload(
          staged_name=staged_name).SerializeToString())


def embedded_artifact(data: bytes, staged_name: str):
  return beam_runner_api_pb2.ArtifactInformation(
      type_urn=EMBEDDED,
      type_payload=beam_runner_api_pb2.EmbeddedFilePayload(
          data=data).SerializeToString(),
      role_urn=STAGING_TO,
      role_payload=beam_runner_api_pb2.ArtifactStagingToRolePayload(
          staged_name=staged_name).SerializeToString())


def url_artifact(url: str):
  return beam_runner_api_pb2.ArtifactInformation(
      type_urn=URL,
      type_payload=beam_runner_api_pb2.ArtifactUrlPayload(
          url=url).SerializeToString())


def file_path(artifact) -> str:
  assert artifact.type_urn == FILE
  return beam_runner_api_pb2.ArtifactFilePayload.FromString(
      artifact.type_payload).path


def listing(root) -> list[str]:
  return sorted(os.listdir(root))


# -- (a) Staging and reading back ---------------------------------------------


def test_stages_artifacts_and_serves_them_byte_identical(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  contents = {
      'big.whl': os.urandom(300_000),
      'small.txt': b'hello artifacts',
      'empty.bin': b'',
  }
  paths = {n: write_file(src / n, data) for n, data in contents.items()}
  deps = {
      'env-a': [
          file_artifact(paths['big.whl'], 'big.whl'),
          embedded_artifact(b'embedded bytes', 'inline.pth'),
          url_artifact('https://example.com/pkg.tar.gz'),
          file_artifact(paths['small.txt'], 'small.txt'),
      ],
      'env-b': [file_artifact(paths['empty.bin'], 'empty.bin')],
      'env-none': [],
  }
  server = servers(tmp_path / 'staged')
  server.staging.register_job('job-1', deps)
  assert not server.staging.is_staged('job-1')
  assert not server.staging.wait_staged('job-1', timeout=0.01)

  server.offer('job-1')

  assert server.staging.is_staged('job-1')
  assert server.staging.wait_staged('job-1', timeout=0)
  resolved = server.staging.resolved_artifacts('job-1')
  assert sorted(resolved) == ['env-a', 'env-b', 'env-none']
  assert resolved['env-none'] == []
  a = resolved['env-a']
  assert [x.type_urn for x in a] == [FILE, FILE, URL, FILE]
  assert a[2] == deps['env-a'][2]  # a URL is kept as is
  expected = [
      contents['big.whl'], b'embedded bytes', None, contents['small.txt']
  ]
  for artifact, original, data in zip(a, deps['env-a'], expected):
    assert artifact.role_urn == original.role_urn
    assert artifact.role_payload == original.role_payload
    if data is not None:
      path = file_path(artifact)
      assert os.path.dirname(path) == server.staging.root
      assert server.read(artifact) == data
      payload = beam_runner_api_pb2.ArtifactFilePayload.FromString(
          artifact.type_payload)
      assert payload.sha256 == hashlib.sha256(data).hexdigest()
  [empty] = resolved['env-b']
  assert server.read(empty) == b''
  # Only the stored files: no temporaries left over.
  assert len(listing(server.staging.root)) == 4
  assert not any(n.startswith('.') for n in listing(server.staging.root))


def test_retrieval_resolves_as_given_and_serves_embedded_data(
    tmp_path, servers):
  server = servers(tmp_path / 'staged')
  artifact = embedded_artifact(b'x' * 200_000, 'data.bin')  # several chunks
  response = server.retrieval_stub.ResolveArtifacts(
      beam_artifact_api_pb2.ResolveArtifactsRequest(artifacts=[artifact]))
  assert list(response.replacements) == [artifact]
  assert server.read(artifact) == b'x' * 200_000


def test_in_process_use_without_grpc(tmp_path):
  """Beam also calls these servicers directly, with no context."""
  src = tmp_path / 'client'
  src.mkdir()
  data = os.urandom(50_000)
  path = write_file(src / 'lib.whl', data)
  staging = ArtifactStagingService(str(tmp_path / 'staged'))
  try:
    staging.register_job('job-local', {'env': [file_artifact(path, 'lib.whl')]})
    client = beam_artifacts.ArtifactRetrievalService(
        file_reader=lambda p: open(p, 'rb'))
    beam_artifacts.offer_artifacts(staging, client, 'job-local')
    resolved = staging.resolved_artifacts('job-local')['env']
    # Beam's worker-side function fetches them through our retrieval service.
    dest = tmp_path / 'worker'
    dest.mkdir()
    [fetched] = beam_artifacts.resolve_artifacts(
        resolved, ArtifactRetrievalService(staging.root), str(dest))
    with open(file_path(fetched), 'rb') as f:
      assert f.read() == data
    with pytest.raises(ArtifactServiceError, match='no-such') as info:
      beam_artifacts.offer_artifacts(staging, client, 'no-such')
    assert info.value.code == grpc.StatusCode.NOT_FOUND
  finally:
    staging.close()


# -- (b) Hostile names --------------------------------------------------------

HOSTILE_NAMES = [
    '../../etc/passwd',
    '/etc/passwd',
    '/tmp/absolute.whl',
    'a/b/c.txt',
    'back\\slash\\..\\..\\win.ini',
    '..',
    '.',
    '',
    '.hidden',
    '-rf',
    'x' * 5000 + '.tar.gz',
    'nul\x00byte.txt',
    'ünïcødé-文件.whl',
    '../' * 50,
]


def test_hostile_staged_names_stay_inside_the_root(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  deps = []
  for i, name in enumerate(HOSTILE_NAMES):
    path = write_file(src / f'f{i}', f'content {i}'.encode())
    deps.append(file_artifact(path, name))
  # The same hostile names on embedded data, which takes another path.
  deps.extend(
      embedded_artifact(f'embedded {i}'.encode(), name)
      for i, name in enumerate(HOSTILE_NAMES))
  root = tmp_path / 'area' / 'staged'
  server = servers(root)
  server.staging.register_job('hostile', {'env': deps})
  server.offer('hostile')

  resolved = server.staging.resolved_artifacts('hostile')['env']
  assert len(resolved) == 2 * len(HOSTILE_NAMES)
  names = listing(root)
  assert len(names) == 2 * len(HOSTILE_NAMES)  # distinct contents
  for name in names:
    assert os.path.isfile(root / name)
    assert not name.startswith(('.', '-'))
    assert len(name.encode()) <= 64 + 1 + MAX_HINT_CHARS
    assert all(c.isascii() and (c.isalnum() or c in '._-') for c in name)
  for artifact in resolved:
    assert os.path.dirname(file_path(artifact)) == server.staging.root
  # Nothing was created next to or above the root.
  assert listing(tmp_path / 'area') == ['staged']
  assert listing(tmp_path) == ['area', 'client']
  # The long name is clipped but keeps its extension.
  long_hint = safe_hint('x' * 5000 + '.tar.gz')
  assert len(long_hint) == MAX_HINT_CHARS and long_hint.endswith('.tar.gz')
  assert safe_hint('../../etc/passwd') == 'passwd'
  assert safe_hint('..') == safe_hint('') == 'artifact'


def test_retrieval_refuses_paths_outside_the_root(tmp_path, servers):
  root = tmp_path / 'staged'
  server = servers(root)
  secret = write_file(tmp_path / 'secret.txt', b'secret')
  os.symlink(secret, root / 'link-out')
  write_file(root / 'inside.txt', b'fine')

  def fetch(path):
    return server.read(
        beam_runner_api_pb2.ArtifactInformation(
            type_urn=FILE,
            type_payload=beam_runner_api_pb2.ArtifactFilePayload(
                path=path).SerializeToString()))

  assert fetch(str(root / 'inside.txt')) == b'fine'
  assert fetch('inside.txt') == b'fine'  # relative to the root
  for path in [secret, '../secret.txt', str(root / '..' / 'secret.txt'),
               str(root / 'link-out'), '/etc/passwd', str(root), '']:
    with pytest.raises(grpc.RpcError) as info:
      fetch(path)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, path
  with pytest.raises(grpc.RpcError) as info:
    fetch('bad\x00path')
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  with pytest.raises(grpc.RpcError) as info:
    fetch(str(root / 'missing'))
  assert info.value.code() == grpc.StatusCode.NOT_FOUND


# -- (c) A failing writer -----------------------------------------------------


class FailingWriter:
  """Writes real files, then raises OSError('disk full') past a limit."""
  def __init__(self, fail_after: int):
    self.fail_after = fail_after
    self.opened = []

  def __call__(self, path):
    handle = open(path, 'xb')
    self.opened.append(path)
    writer = self

    class Handle:
      written = 0

      def write(self, data):
        if self.written + len(data) > writer.fail_after:
          raise OSError('disk full')
        self.written += len(data)
        handle.write(data)

      def close(self):
        handle.close()

      def __enter__(self):
        return self

      def __exit__(self, *exc):
        self.close()

    return Handle()


def test_writer_failure_reaches_client_and_leaves_no_files(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  small = write_file(src / 'small', b's' * 1000)
  big = write_file(src / 'big', os.urandom(1 << 20))
  writer = FailingWriter(fail_after=200_000)
  server = servers(tmp_path / 'staged', file_writer=writer)
  server.staging.register_job(
      'job-disk', {
          'env': [
              file_artifact(small, 'small.txt'),
              file_artifact(big, 'big.bin'),
              file_artifact(small, 'after.txt'),
          ]
      })

  with pytest.raises(grpc.RpcError) as info:
    server.offer('job-disk')

  assert info.value.code() == grpc.StatusCode.INTERNAL
  details = info.value.details()
  assert 'OSError: disk full' in details
  assert 'big.bin' in details and 'job-disk' in details
  # The small artifact was stored, then removed with the failed attempt;
  # the big one's temporary file was removed too.
  assert len(writer.opened) >= 2
  assert listing(server.staging.root) == []
  assert not server.staging.is_staged('job-disk')
  with pytest.raises(ArtifactStagingError, match='disk full'):
    server.staging.wait_staged('job-disk', timeout=1)
  with pytest.raises(ArtifactStagingError, match='not staged'):
    server.staging.resolved_artifacts('job-disk')
  assert server.staging.buffered_bytes == 0

  # A failed attempt may be retried, here on a healthy disk.
  writer.fail_after = 1 << 30
  server.offer('job-disk')
  assert server.staging.is_staged('job-disk')
  assert len(listing(server.staging.root)) == 2  # small twice: stored once


def test_failing_file_writer_on_open(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  path = write_file(src / 'f', b'data')

  def no_space(path):
    raise PermissionError(13, 'read-only staging area')

  server = servers(tmp_path / 'staged', file_writer=no_space)
  server.staging.register_job('job-ro', {'env': [file_artifact(path, 'f')]})
  with pytest.raises(grpc.RpcError) as info:
    server.offer('job-ro')
  assert 'PermissionError' in info.value.details()
  assert 'read-only staging area' in info.value.details()
  assert listing(server.staging.root) == []


# -- (d) Content addressing and removal ---------------------------------------


def test_identical_content_is_stored_once_and_reference_counted(
    tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  shared = os.urandom(100_000)
  one = write_file(src / 'one', shared)
  two = write_file(src / 'two', shared)
  only_b = write_file(src / 'only-b', b'only job b')
  server = servers(tmp_path / 'staged')
  server.staging.register_job('job-a', {'env': [file_artifact(one, 'x.whl')]})
  server.staging.register_job(
      'job-b', {
          'env': [
              file_artifact(two, 'renamed.whl'),
              file_artifact(only_b, 'b.txt'),
          ]
      })
  server.offer('job-a')
  server.offer('job-b')

  [a] = server.staging.resolved_artifacts('job-a')['env']
  b_shared, b_own = server.staging.resolved_artifacts('job-b')['env']
  assert file_path(a) == file_path(b_shared)
  assert len(listing(server.staging.root)) == 2

  server.staging.remove_job('job-a')
  assert os.path.exists(file_path(b_shared))
  assert server.read(b_shared) == shared
  assert len(listing(server.staging.root)) == 2
  with pytest.raises(UnknownStagingTokenError, match='job-a'):
    server.staging.resolved_artifacts('job-a')

  server.staging.remove_job('job-b')
  assert listing(server.staging.root) == []
  server.staging.remove_job('job-b')  # unknown tokens are ignored


# -- (e) Bounded memory, parallel writes --------------------------------------


class SlowWriter:
  """Real files, each write delayed; records concurrent writes."""
  def __init__(self, delay: float):
    self.delay = delay
    self._lock = threading.Lock()
    self.active = 0
    self.max_active = 0

  def __call__(self, path):
    handle = open(path, 'xb')
    writer = self

    class Handle:
      def write(self, data):
        with writer._lock:
          writer.active += 1
          writer.max_active = max(writer.max_active, writer.active)
        try:
          time.sleep(writer.delay)
          handle.write(data)
        finally:
          with writer._lock:
            writer.active -= 1

      def close(self):
        handle.close()

    return Handle()


def test_memory_stays_within_budget_with_a_slow_disk(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  data = os.urandom(20 << 20)
  path = write_file(src / 'big', data)
  budget, chunk = 1 << 20, 64 << 10
  server = servers(
      tmp_path / 'staged',
      max_buffered_bytes=budget,
      file_writer=SlowWriter(delay=0.001))
  server.staging.register_job('job-big', {'env': [file_artifact(path, 'big')]})

  server.offer('job-big', chunk_size=chunk)

  peak = server.staging.peak_buffered_bytes
  assert peak <= budget + chunk
  # The disk was the bottleneck, so the budget really filled up: the client
  # was throttled rather than the bound being met by luck.
  assert peak >= budget // 2
  assert server.staging.buffered_bytes == 0
  [artifact] = server.staging.resolved_artifacts('job-big')['env']
  with open(file_path(artifact), 'rb') as f:
    assert f.read() == data


def test_artifacts_are_written_in_parallel(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  deps, contents = [], []
  for i in range(4):
    contents.append(os.urandom(512 << 10))
    deps.append(file_artifact(write_file(src / f'f{i}', contents[-1]), f'f{i}'))
  writer = SlowWriter(delay=0.01)
  server = servers(tmp_path / 'staged', writers=4, file_writer=writer)
  server.staging.register_job('job-par', {'env': deps})

  server.offer('job-par', chunk_size=64 << 10)

  assert writer.max_active > 1
  resolved = server.staging.resolved_artifacts('job-par')['env']
  assert [server.read(a) for a in resolved] == contents


# -- (f) Tokens ---------------------------------------------------------------


def test_unknown_staging_token_is_an_error_naming_it(tmp_path, servers):
  server = servers(tmp_path / 'staged')
  with pytest.raises(grpc.RpcError) as info:
    server.offer('no-such-token-42')
  assert info.value.code() == grpc.StatusCode.NOT_FOUND
  assert 'no-such-token-42' in info.value.details()
  with pytest.raises(UnknownStagingTokenError, match='no-such-token-42'):
    server.staging.wait_staged('no-such-token-42', timeout=0)


def test_a_staged_job_is_not_staged_twice(tmp_path, servers):
  server = servers(tmp_path / 'staged')
  server.staging.register_job('job-twice', {})
  server.offer('job-twice')
  assert server.staging.resolved_artifacts('job-twice') == {}
  with pytest.raises(grpc.RpcError) as info:
    server.offer('job-twice')
  assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
  with pytest.raises(ValueError, match='job-twice'):
    server.staging.register_job('job-twice', {})


# -- Clients that misbehave or go away ----------------------------------------


class ManualClient:
  """Drives a staging stream message by message (Beam's client cannot)."""
  def __init__(self, server: ArtifactServer, token: str):
    self._outgoing = queue.Queue()
    self.send(
        beam_artifact_api_pb2.ArtifactResponseWrapper(staging_token=token))
    self.call = server.staging_stub.ReverseArtifactRetrievalService(
        iter(self._outgoing.get, None))

  def send(self, response) -> None:
    self._outgoing.put(response)

  def close(self) -> None:
    self._outgoing.put(None)

  def answer_resolve(self):
    request = next(self.call)
    assert request.HasField('resolve_artifact')
    self.send(
        beam_artifact_api_pb2.ArtifactResponseWrapper(
            resolve_artifact_response=beam_artifact_api_pb2.
            ResolveArtifactsResponse(
                replacements=request.resolve_artifact.artifacts)))
    return [next(self.call) for _ in request.resolve_artifact.artifacts]

  def send_chunks(self, count: int, size: int = 64 << 10) -> None:
    for _ in range(count):
      self.send(
          beam_artifact_api_pb2.ArtifactResponseWrapper(
              get_artifact_response=beam_artifact_api_pb2.GetArtifactResponse(
                  data=b'x' * size)))


def wait_for(condition, timeout=5.0):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, 'timed out'
    time.sleep(0.01)


def test_client_going_away_mid_artifact_leaves_no_files(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  path = write_file(src / 'f', b'data')
  server = servers(
      tmp_path / 'staged', max_buffered_bytes=256 << 10,
      file_writer=SlowWriter(delay=0.005))
  server.staging.register_job('job-gone', {'env': [file_artifact(path, 'f')]})
  client = ManualClient(server, 'job-gone')
  client.answer_resolve()
  client.send_chunks(20)
  wait_for(lambda: listing(server.staging.root))  # a partial file exists
  client.call.cancel()
  with pytest.raises(ArtifactStagingError, match='cancelled'):
    server.staging.wait_staged('job-gone', timeout=5)
  wait_for(lambda: not listing(server.staging.root))
  wait_for(lambda: server.staging.buffered_bytes == 0)
  client.close()
  # The job can be staged again, by a well-behaved client.
  server.offer('job-gone')
  assert server.staging.is_staged('job-gone')


def test_protocol_violation_is_refused(tmp_path, servers):
  server = servers(tmp_path / 'staged')
  server.staging.register_job(
      'job-rude', {'env': [embedded_artifact(b'a', 'a')]})
  client = ManualClient(server, 'job-rude')
  next(client.call)  # the resolve request
  client.send_chunks(1)  # a chunk where a resolve answer is due
  with pytest.raises(grpc.RpcError) as info:
    next(client.call)
  client.close()
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert 'job-rude' in info.value.details()
  assert 'resolving' in info.value.details()


def test_removing_a_job_while_staging_stops_the_stream(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  path = write_file(src / 'f', b'data')
  server = servers(tmp_path / 'staged')
  server.staging.register_job(
      'job-removed', {'env': [file_artifact(path, 'f')]})
  client = ManualClient(server, 'job-removed')
  client.answer_resolve()
  client.send_chunks(3)
  wait_for(lambda: listing(server.staging.root))
  server.staging.remove_job('job-removed')
  with pytest.raises(grpc.RpcError) as info:
    next(client.call)
  client.close()
  assert info.value.code() == grpc.StatusCode.ABORTED
  assert 'job-removed' in info.value.details()
  assert listing(server.staging.root) == []


# -- The protocol state machine, without I/O ----------------------------------


def test_protocol_state_machine():
  fetch = file_artifact(__file__, 'this.py')
  embed = embedded_artifact(b'abc', 'e')
  url = url_artifact('https://example.com/x')
  protocol = staging_module.StagingProtocol(
      'tok', {'e1': [fetch, embed, url], 'e2': [], 'e3': [fetch]})
  Phase = staging_module.Phase

  [send] = protocol.start()
  assert protocol.phase is Phase.RESOLVING
  assert list(send.request.resolve_artifact.artifacts) == [fetch, embed, url]

  resolved = beam_artifact_api_pb2.ArtifactResponseWrapper(
      resolve_artifact_response=beam_artifact_api_pb2.ResolveArtifactsResponse(
          replacements=[fetch, embed, url]))
  out = protocol.receive(resolved)
  assert [type(i).__name__ for i in out] == [
      'StoreEmbedded', 'KeepArtifact', 'SendRequest'
  ]
  assert out[2].request.get_artifact.artifact == fetch
  assert out[0].data == b'abc' and out[0].index == 1
  assert protocol.phase is Phase.FETCHING

  def chunk(data, last=False):
    return beam_artifact_api_pb2.ArtifactResponseWrapper(
        get_artifact_response=beam_artifact_api_pb2.GetArtifactResponse(
            data=data),
        is_last=last)

  assert protocol.receive(chunk(b'12')) == [
      staging_module.BeginFetch('e1', 0, fetch),
      staging_module.FetchChunk(b'12')
  ]
  assert protocol.receive(chunk(b'34')) == [staging_module.FetchChunk(b'34')]
  out = protocol.receive(chunk(b'', last=True))
  # e2 has no dependencies, and is asked about all the same: a client may
  # wait for its request (Beam's TypeScript client does).
  assert out[0] == staging_module.EndFetch()
  assert list(out[1].request.resolve_artifact.artifacts) == []
  out = protocol.receive(
      beam_artifact_api_pb2.ArtifactResponseWrapper(
          resolve_artifact_response=beam_artifact_api_pb2.
          ResolveArtifactsResponse()))
  assert list(out[0].request.resolve_artifact.artifacts) == [fetch]

  # Chunks where a resolve answer is due break the protocol.
  with pytest.raises(staging_module.ProtocolError, match='resolving'):
    protocol.receive(chunk(b'x'))
  assert protocol.phase is Phase.FAILED


def test_protocol_asks_for_one_artifact_at_a_time():
  """The chunks name no artifact: with two get requests out, a client that
  serves them concurrently (Beam's TypeScript client) interleaves two files'
  chunks, and both arrive corrupt. Beam's staging service asks one by one."""
  first = file_artifact(__file__, 'one.py')
  second = file_artifact(__file__, 'two.py')
  protocol = staging_module.StagingProtocol('tok', {'env': [first, second]})
  protocol.start()
  out = protocol.receive(
      beam_artifact_api_pb2.ArtifactResponseWrapper(
          resolve_artifact_response=beam_artifact_api_pb2.
          ResolveArtifactsResponse(replacements=[first, second])))
  assert [i.request.get_artifact.artifact for i in out] == [first]

  def chunk(data, last=False):
    return beam_artifact_api_pb2.ArtifactResponseWrapper(
        get_artifact_response=beam_artifact_api_pb2.GetArtifactResponse(
            data=data),
        is_last=last)

  assert protocol.receive(chunk(b'1')) == [
      staging_module.BeginFetch('env', 0, first),
      staging_module.FetchChunk(b'1')]
  end, ask = protocol.receive(chunk(b'', last=True))
  assert end == staging_module.EndFetch()
  assert ask.request.get_artifact.artifact == second
  assert protocol.receive(chunk(b'2', last=True)) == [
      staging_module.BeginFetch('env', 1, second),
      staging_module.FetchChunk(b'2'), staging_module.EndFetch(),
      staging_module.Finished()]


def test_protocol_asks_about_an_environment_with_nothing_to_stage():
  protocol = staging_module.StagingProtocol('tok', {'env': []})
  [request] = protocol.start()
  assert list(request.request.resolve_artifact.artifacts) == []
  assert protocol.receive(
      beam_artifact_api_pb2.ArtifactResponseWrapper(
          resolve_artifact_response=beam_artifact_api_pb2.
          ResolveArtifactsResponse())) == [staging_module.Finished()]
  assert protocol.phase is staging_module.Phase.FINISHED


def test_protocol_with_no_environment_finishes_at_once():
  protocol = staging_module.StagingProtocol('tok', {})
  assert protocol.start() == [staging_module.Finished()]


# -- Restarts: manifests and recovery -----------------------------------------


def test_recovery_keeps_retained_jobs_and_deletes_the_rest(tmp_path, servers):
  """Two processes, one after the other, over the same directories."""
  src = tmp_path / 'client'
  src.mkdir()
  shared = os.urandom(100_000)
  deps = {
      'job-kept': [
          file_artifact(write_file(src / 's1', shared), 'shared.whl'),
          file_artifact(write_file(src / 'k', b'kept only'), 'k.txt'),
          url_artifact('https://example.com/kept.tar.gz'),
      ],
      'job-gone': [
          file_artifact(write_file(src / 's2', shared), 'shared.whl'),
          file_artifact(write_file(src / 'g', b'gone only'), 'g.txt'),
      ],
  }
  root, manifests = tmp_path / 'staged', tmp_path / 'manifests'
  first = servers(root, manifest_dir=str(manifests))
  for token, artifacts in deps.items():
    first.staging.register_job(token, {'env': artifacts})
    first.offer(token)
  kept_before = first.staging.resolved_artifacts('job-kept')
  gone_own = file_path(first.staging.resolved_artifacts('job-gone')['env'][1])
  first.stop()
  assert len(listing(manifests)) == 2
  write_file(root / ('.partial-' + 'ab' * 16), b'cut short')
  write_file(root / f'{"0" * 64}-orphan.bin', b'committed, never recorded')
  os.mkdir(root / 'not-ours')

  second = servers(root, manifest_dir=str(manifests))
  recovery = second.staging.recover(['job-kept', 'job-never-staged'])

  assert recovery.kept_jobs == ['job-kept']
  assert recovery.forgotten_jobs == ['job-gone']
  assert sorted(recovery.deleted_files) == sorted([
      os.path.basename(gone_own), '.partial-' + 'ab' * 16,
      f'{"0" * 64}-orphan.bin'])
  assert recovery.foreign_files == ['not-ours']
  assert second.staging.is_staged('job-kept')
  assert second.staging.resolved_artifacts('job-kept') == kept_before
  assert not second.staging.is_staged('job-gone')
  shared_file, kept_file, _ = kept_before['env']
  assert second.read(shared_file) == shared
  assert second.read(kept_file) == b'kept only'
  assert second.staging.stages_url('https://example.com/kept.tar.gz')
  assert len(listing(manifests)) == 1

  # The recovered job is removed like any other, files and record.
  second.staging.remove_job('job-kept')
  assert listing(root) == ['not-ours']
  assert listing(manifests) == []
  assert not second.staging.stages_url('https://example.com/kept.tar.gz')


def test_recovery_reports_missing_files(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  root, manifests = tmp_path / 'staged', tmp_path / 'manifests'
  first = servers(root, manifest_dir=str(manifests))
  first.staging.register_job(
      'job-x', {
          'env': [
              file_artifact(write_file(src / 'a', b'aaa'), 'a.txt'),
              file_artifact(write_file(src / 'b', b'bbb'), 'b.txt'),
          ]
      })
  first.offer('job-x')
  a, b = first.staging.resolved_artifacts('job-x')['env']
  first.stop()
  os.remove(file_path(b))

  second = servers(root, manifest_dir=str(manifests))
  assert second.staging.recover(['job-x']).kept_jobs == ['job-x']
  with pytest.raises(ArtifactStagingError, match='missing') as info:
    second.staging.resolved_artifacts('job-x')
  assert os.path.basename(file_path(b)) in str(info.value)
  # What is left is still held, and goes with the job.
  assert os.path.exists(file_path(a))
  second.staging.remove_job('job-x')
  assert listing(root) == [] and listing(manifests) == []


def test_failed_or_removed_staging_leaves_no_record(tmp_path, servers):
  src = tmp_path / 'client'
  src.mkdir()
  manifests = tmp_path / 'manifests'
  writer = FailingWriter(fail_after=1000)
  server = servers(
      tmp_path / 'staged', file_writer=writer, manifest_dir=str(manifests))
  big = file_artifact(write_file(src / 'big', os.urandom(50_000)), 'big')
  server.staging.register_job('job-fail', {'env': [big]})
  with pytest.raises(grpc.RpcError):
    server.offer('job-fail')
  assert listing(manifests) == []
  writer.fail_after = 1 << 30
  server.offer('job-fail')
  assert len(listing(manifests)) == 1
  server.staging.remove_job('job-fail')
  assert listing(manifests) == []


def test_recover_needs_a_manifest_dir(tmp_path):
  staging = ArtifactStagingService(str(tmp_path / 'staged'))
  try:
    with pytest.raises(ArtifactStagingError, match='manifest_dir'):
      staging.recover([])
  finally:
    staging.close()


def test_url_artifacts_need_an_explicit_allow_rule(tmp_path, servers):
  with pytest.raises(ValueError, match='url_allowed'):
    ArtifactRetrievalService(str(tmp_path), url_opener=open)
  # Without an opener, URLs are refused, saying what is served.
  server = servers(tmp_path / 'staged')
  with pytest.raises(grpc.RpcError) as info:
    server.read(url_artifact('https://example.com/x.whl'))
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert URL in info.value.details()


def test_url_policy_allows_only_its_prefixes(tmp_path):
  from beam_pyspark.artifacts.urls import UrlNotAllowedError
  from beam_pyspark.artifacts.urls import UrlPolicy
  jars = tmp_path / 'jars'
  jars.mkdir()
  (tmp_path / 'secret').write_text('x')
  os.symlink(tmp_path / 'secret', jars / 'link.jar')
  policy = UrlPolicy([f'https://repo.example.com/jars,{jars.as_uri()}',
                      'gs://'])
  allowed = ['https://repo.example.com/jars/a.jar',
             'https://REPO.example.com:443/jars/sub/b.jar',
             f'{jars.as_uri()}/a.jar', str(jars / 'a.jar'), 'gs://any/x']
  refused = ['https://repo.example.com/jars2/a.jar',
             'https://repo.example.com/jars/../admin',
             'https://repo.example.com/jars/%2e%2e/admin',
             'http://repo.example.com/jars/a.jar',
             'https://repo.example.com:8443/jars/a.jar',
             'https://repo.example.com@evil.example/jars/a.jar',
             f'{jars.as_uri()}/../secret', str(jars / 'link.jar'),
             'file://otherhost/etc/passwd', 's3://bucket/x']
  assert [u for u in allowed if not policy.allows(u)] == []
  assert [u for u in refused if policy.allows(u)] == []
  with pytest.raises(UrlNotAllowedError, match='--artifact-url-allowlist'):
    UrlPolicy().check('https://repo.example.com/jars/a.jar')
  for bad in ('repo.example.com', 'https:nohost'):
    with pytest.raises(ValueError, match=re.escape(bad)):
      UrlPolicy([bad])
