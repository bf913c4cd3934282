"""The I/O of one staging stream (``ReverseArtifactRetrievalService``).

A reader thread consumes the client's messages, drives the protocol
(``protocol.StagingProtocol``) and hands chunks to ``ArtifactSink``s
written by the service's pool of writer threads; gRPC's handler thread
sends requests and, on any error, the root cause. The stream reaches the
service only through the ``StagingHost`` it is given.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import os
import threading
import time
import uuid
from typing import Iterator
from typing import Optional
from typing import Protocol
from typing import Sequence
from typing import Union

import grpc
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.artifacts.retrieval import abort
from beam_pyspark.artifacts.store import ArtifactSink
from beam_pyspark.artifacts.store import BlobStore
from beam_pyspark.artifacts.store import ByteBudget
from beam_pyspark.artifacts.store import StoredBlob
from beam_pyspark.artifacts.protocol import ArtifactInformation
from beam_pyspark.artifacts.protocol import ArtifactStagingError
from beam_pyspark.artifacts.protocol import BeginFetch
from beam_pyspark.artifacts.protocol import DependencySets
from beam_pyspark.artifacts.protocol import EndFetch
from beam_pyspark.artifacts.protocol import FetchChunk
from beam_pyspark.artifacts.protocol import Finished
from beam_pyspark.artifacts.protocol import Instruction
from beam_pyspark.artifacts.protocol import KeepArtifact
from beam_pyspark.artifacts.protocol import ProtocolError
from beam_pyspark.artifacts.protocol import ReuseStored
from beam_pyspark.artifacts.protocol import declared_sha256
from beam_pyspark.artifacts.protocol import SendRequest
from beam_pyspark.artifacts.protocol import StagingProtocol
from beam_pyspark.artifacts.protocol import StoreEmbedded
from beam_pyspark.artifacts.urls import UrlNotAllowedError
from beam_pyspark.artifacts.urls import UrlPolicy
from beam_pyspark.artifacts.urls import artifact_url
from beam_pyspark.artifacts.protocol import FILE_URN
from beam_pyspark.artifacts.protocol import Phase

_LOGGER = logging.getLogger(__name__)

# gRPC trailers carry the details; a runaway exception message must not
# make them huge.
_MAX_DETAILS_CHARS = 2000


class StagingHost(Protocol):
  """What a stream needs of the service that started it."""
  store: BlobStore
  budget: ByteBudget
  writers: concurrent.futures.Executor
  max_artifact_bytes: int
  # Which URL artifacts may be kept as URLs, for the job server to fetch;
  # None: any (no job server fetches them).
  url_policy: Optional[UrlPolicy]

  def record_staged(self, staging_token: str, files: Sequence[str],
                    resolved: DependencySets) -> None:
    """Notes the stored files before the job counts as staged."""

  def forget_staged(self, staging_token: str) -> None:
    """Undoes record_staged after a failure."""

  def staging_succeeded(self, stream: 'StagingStream',
                        resolved: DependencySets) -> bool:
    """False if the job was removed meanwhile."""

  def staging_failed(self, stream: 'StagingStream', failure) -> None:
    ...


@dataclasses.dataclass(frozen=True)
class _Reused:
  """An artifact whose content the store already held."""
  artifact: ArtifactInformation
  stored: StoredBlob


_Slot = Union[ArtifactInformation, ArtifactSink, _Reused]


@dataclasses.dataclass
class Failure:
  code: grpc.StatusCode
  message: str
  cause: Optional[BaseException] = None


_DONE = object()


class _StreamAbandoned(Exception):
  """The stream failed elsewhere; the reader just stops."""


def _describe(exn: BaseException) -> str:
  return f'{type(exn).__name__}: {exn}'


class StagingStream:
  """The I/O of one ReverseArtifactRetrievalService call.

  Two threads serve it. gRPC's handler thread (``serve``) sends what
  ``_outbox`` holds: requests, then either the end of the stream or a
  failure. A reader thread of ours consumes the client's messages, drives the
  protocol and feeds the sinks. Because the handler waits on the outbox and
  not on the client, an error found anywhere (a writer, the reader, a
  removed job) reaches the client at once, even while the reader is blocked
  waiting for the client's next message.
  """
  def __init__(
      self,
      host: StagingHost,
      staging_token: str,
      dependency_sets: DependencySets,
      responses: Iterator[beam_artifact_api_pb2.ArtifactResponseWrapper],
      context: Optional[grpc.ServicerContext]):
    self.staging_token = staging_token
    # Holds the stored files for this attempt; unique, so a failed attempt
    # or a later job with the same token never releases another's files.
    self.holder = f'{staging_token}#{uuid.uuid4().hex}'
    self._host = host
    self._store = host.store
    self._budget = host.budget
    self._protocol = StagingProtocol(
        staging_token, dependency_sets, reuse=self._hold_stored)
    self._responses = responses
    self._context = context
    self._outbox: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._sinks: list[ArtifactSink] = []  # _lock
    self._failure: Optional[Failure] = None  # _lock
    self._completed = False  # _lock: staged; failures no longer apply
    self._cleanup_lock = threading.Lock()
    self._cleaned = False  # _cleanup_lock
    # Confined to the reader thread: env -> index -> artifact or sink.
    self._results: dict[str, dict[int, _Slot]] = {
        env: {} for env in dependency_sets
    }
    self._current: Optional[ArtifactSink] = None  # reader thread only
    # sha256 -> the stored file this stream holds without fetching it.
    self._reused: dict[str, StoredBlob] = {}  # reader thread only
    self._started = time.monotonic()

  @property
  def failed(self) -> bool:
    return self._failure is not None

  def fail(self, failure: Failure) -> None:
    """Ends the stream with this failure; the first one wins. Non-blocking."""
    with self._lock:
      if self._failure is not None or self._completed:
        return
      self._failure = failure
    self._budget.wake()
    self._outbox.put(failure)

  # The handler thread.

  def serve(self) -> Iterator[beam_artifact_api_pb2.ArtifactRequestWrapper]:
    reader = threading.Thread(
        target=self._read,
        name=f'artifact-staging-{self.staging_token}',
        daemon=True)
    reader.start()
    finished = False
    try:
      while True:
        item = self._outbox.get()
        if item is _DONE:
          finished = True
          return
        if isinstance(item, Failure):
          # Clean up before the client hears of it, so that when its call
          # fails no partial file is left behind.
          self.cleanup()
          abort(self._context, item.code, item.message[:_MAX_DETAILS_CHARS])
        yield item
    finally:
      if not finished:
        # gRPC stopped iterating (the client went away): let the reader
        # notice and clean up.
        self.fail(Failure(grpc.StatusCode.CANCELLED, 'stream ended early'))

  # The reader thread.

  def _read(self) -> None:
    try:
      self._execute(self._protocol.start())
      while self._protocol.phase is not Phase.FINISHED:
        try:
          response = next(self._responses)
        except StopIteration:
          raise ProtocolError(
              'the client closed the stream before staging finished '
              f'({self._protocol.describe()})') from None
        if self.failed:
          return
        self._execute(self._protocol.receive(response))
      self._complete()
    except _StreamAbandoned:
      pass
    except ProtocolError as exn:
      self.fail(
          Failure(
              grpc.StatusCode.INVALID_ARGUMENT,
              f'Staging artifacts for {self.staging_token!r} failed: the '
              f'client broke the reverse retrieval protocol: {exn}',
              exn))
    except grpc.RpcError as exn:
      self.fail(
          Failure(
              grpc.StatusCode.CANCELLED,
              f'Staging artifacts for {self.staging_token!r} ended: the '
              'client cancelled the call or disconnected',
              exn))
    except Exception as exn:  # pylint: disable=broad-except
      _LOGGER.exception('Staging artifacts for %r failed', self.staging_token)
      self.fail(
          Failure(
              grpc.StatusCode.INTERNAL,
              f'Staging artifacts for {self.staging_token!r} failed: '
              f'{_describe(exn)}',
              exn))
    finally:
      if self.failed:
        self.cleanup()

  def _execute(self, instructions: Sequence[Instruction]) -> None:
    for instruction in instructions:
      match instruction:
        case SendRequest(request):
          self._outbox.put(request)
        case KeepArtifact(env, index, artifact):
          self._check_url(env, artifact)
          self._results[env][index] = artifact
        case ReuseStored(env, index, artifact, digest):
          self._results[env][index] = _Reused(artifact, self._reused[digest])
        case StoreEmbedded(env, index, artifact, data):
          sink = self._results[env][index] = self._new_sink(env, artifact)
          self._feed(sink, data)
          sink.close()
        case BeginFetch(env, index, artifact):
          self._current = self._new_sink(env, artifact)
          self._results[env][index] = self._current
        case FetchChunk(data):
          self._feed(self._current, data)
        case EndFetch():
          self._current.close()
          self._current = None
        case Finished():
          pass

  def _check_url(self, env: str, artifact: ArtifactInformation) -> None:
    """A URL the client resolved an artifact to is fetched by the job
    server later: refused unless its URL policy allows it (urls.py)."""
    policy = self._host.url_policy
    if policy is None:
      return
    try:
      policy.check(artifact_url(artifact) or '',
                   f'The URL artifact of environment {env!r}')
    except UrlNotAllowedError as exn:
      self.fail(Failure(
          grpc.StatusCode.PERMISSION_DENIED,
          f'Staging artifacts for {self.staging_token!r} refused: {exn}'))
      raise _StreamAbandoned() from exn

  def _hold_stored(self, digest: str) -> bool:
    """The protocol's ``reuse``: takes a reference to stored content under
    the stream's lock, so that a failure's cleanup (which releases this
    stream's holder after the failure is set) cannot miss it."""
    with self._lock:
      if self._failure is not None:
        raise _StreamAbandoned()
      stored = self._store.hold(digest, self.holder)
    if stored is None:
      return False
    self._reused[digest] = stored
    return True

  def _new_sink(
      self, env: str, artifact: ArtifactInformation) -> ArtifactSink:
    with self._lock:
      if self._failure is not None:
        raise _StreamAbandoned()
      sink = ArtifactSink(
          self._store, self._host.writers, self._budget, self.holder, env,
          artifact, self._on_sink_failure)
      self._sinks.append(sink)
      return sink

  def _feed(self, sink: ArtifactSink, data: bytes) -> None:
    if not data:
      return
    sink.received += len(data)
    limit = self._host.max_artifact_bytes
    if sink.received > limit:
      self.fail(Failure(
          grpc.StatusCode.RESOURCE_EXHAUSTED,
          f'Staging artifacts for {self.staging_token!r} refused: '
          f'{sink.name!r} (environment {sink.environment!r}) is larger than '
          f'the {limit} bytes ({limit / (1 << 20):.0f} MiB) this job server '
          'accepts for one artifact (--max-artifact-bytes).'))
      raise _StreamAbandoned()
    # Blocking here is the back-pressure: while we do not read, gRPC's flow
    # control stops the client.
    if not self._budget.acquire(len(data), lambda: self.failed):
      raise _StreamAbandoned()
    sink.put(data)

  def _on_sink_failure(self, sink: ArtifactSink, exn: BaseException) -> None:
    self.fail(
        Failure(
            grpc.StatusCode.INTERNAL,
            f'Staging artifacts for {self.staging_token!r} failed while '
            f'writing {sink.name!r} (environment {sink.environment!r}): '
            f'{_describe(exn)}',
            exn))

  def _complete(self) -> None:
    with self._lock:
      sinks = list(self._sinks)
    concurrent.futures.wait([s.result for s in sinks])
    if self.failed or any(s.result.exception() for s in sinks):
      return  # the failure is already on its way to the client
    for sink in sinks:
      # What the client declared is what a later job's reuse trusts: the
      # bytes it sent must be that content.
      declared = declared_sha256(sink.artifact)
      stored = sink.result.result()
      if declared is not None and declared != stored.sha256:
        self.fail(Failure(
            grpc.StatusCode.INVALID_ARGUMENT,
            f'Staging artifacts for {self.staging_token!r} failed: '
            f'{sink.name!r} (environment {sink.environment!r}) declares '
            f'sha256 {declared}, but the {stored.size} bytes the client sent '
            f'have sha256 {stored.sha256}. The file changed while it was '
            'staged, or the client computed its hash wrongly; submit the job '
            'again.'))
        return
    resolved: DependencySets = {}
    fetched_bytes = 0
    reused = 0
    stored_files = []
    for env, slots in self._results.items():
      resolved[env] = []
      for _, entry in sorted(slots.items()):
        if isinstance(entry, (ArtifactSink, _Reused)):
          original = entry.artifact
          if isinstance(entry, ArtifactSink):
            stored = entry.result.result()
            fetched_bytes += stored.size
          else:
            stored = entry.stored
            reused += 1
          stored_files.append(os.path.basename(stored.path))
          entry = ArtifactInformation(
              type_urn=FILE_URN,
              type_payload=beam_runner_api_pb2.ArtifactFilePayload(
                  path=stored.path, sha256=stored.sha256).SerializeToString(),
              role_urn=original.role_urn,
              role_payload=original.role_payload)
        resolved[env].append(entry)
    # Recorded before the job counts as staged, so that a restarted server
    # knows these files are in use. A failure from here on removes it again
    # (cleanup), as does the job's removal.
    self._host.record_staged(self.staging_token, stored_files, resolved)
    with self._lock:
      if self._failure is not None:
        return
      self._completed = True
    if not self._host.staging_succeeded(self, resolved):
      # remove_job ran meanwhile: nobody will use these files. The handler
      # cleans up (releases them) before telling the client.
      failure = Failure(
          grpc.StatusCode.ABORTED,
          f'Job {self.staging_token!r} was removed while its artifacts were '
          'being staged.')
      with self._lock:
        self._failure = failure
      self._outbox.put(failure)
      return
    # tests/test_sdk_java.py reads this line: keep its wording.
    _LOGGER.info(
        'Staged artifacts for %r: %d artifacts, %d fetched (%d bytes), %d '
        'already stored, in %.1f s', self.staging_token,
        sum(map(len, resolved.values())), len(sinks), fetched_bytes, reused,
        time.monotonic() - self._started)
    self._outbox.put(_DONE)

  # Either thread.

  def cleanup(self) -> None:
    """After a failure: stop writers, remove this attempt's files.

    Blocks until done, whichever thread gets here first; never runs on a
    writer thread, which it may wait for.
    """
    with self._cleanup_lock:
      if self._cleaned:
        return
      self._cleaned = True
      with self._lock:
        sinks = list(self._sinks)
        failure = self._failure
      reason = ArtifactStagingError(failure.message if failure else 'aborted')
      for sink in sinks:
        sink.cancel(reason)
      concurrent.futures.wait([s.result for s in sinks])
      deleted = self._store.release(self.holder)
      self._host.forget_staged(self.staging_token)
      self._host.staging_failed(self, failure)
      # A writer's traceback helps whoever runs the server; a client going
      # away or breaking the protocol needs none.
      internal = failure and failure.code is grpc.StatusCode.INTERNAL
      _LOGGER.warning(
          'Staging artifacts for %r failed (%s); removed %d stored files',
          self.staging_token, failure.message if failure else 'aborted',
          deleted, exc_info=failure.cause if internal else None)
