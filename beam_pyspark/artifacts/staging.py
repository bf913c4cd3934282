"""Artifact staging: the runner side of Beam's reverse retrieval protocol.

The job service registers a job's dependencies (environment id -> artifacts)
at Prepare. The client then opens ``ReverseArtifactRetrievalService`` and
sends its staging token; from there the *server* asks and the client answers:

  server: resolve_artifact(env 1)     client: resolve_artifact_response
  server: get_artifact(a), get(b)...  client: chunks of a ... is_last,
                                              chunks of b ... is_last
  server: resolve_artifact(env 2)     ...
  server: (closes the stream)         the client's offer_artifacts returns

After resolution, URL artifacts are kept as they are, EMBEDDED data is written
straight to the store, and everything else (FILE and unknown types, which only
the client can read) is fetched, as Beam's Python ``resolve_as_files`` does.

Three concerns are kept apart:

* ``StagingProtocol`` is the per-stream state machine, with no I/O: responses
  in, instructions out. Its tests feed messages and compare instructions.
* ``_StagingStream`` does the I/O of one stream: a reader thread consumes the
  client's messages and hands chunks to ``ArtifactSink``s, gRPC's handler
  thread sends requests and, on any error, the root cause.
* Chunks are written by a bounded pool of writer threads, several artifacts
  in parallel, and the bytes received but not yet written are bounded by one
  ``ByteBudget`` shared by all streams: when it is used up the reader stops
  reading, gRPC flow control stops the client, and a slow disk throttles the
  client instead of filling memory.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import queue
import os
import threading
import time
import uuid
from typing import Iterable
from typing import Iterator
from typing import Mapping
from typing import Optional
from typing import Sequence
from typing import Union

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.artifacts.manifests import ManifestStore
from beam_pyspark.artifacts.retrieval import abort
from beam_pyspark.artifacts.store import ArtifactSink
from beam_pyspark.artifacts.store import BlobStore
from beam_pyspark.artifacts.store import ByteBudget
from beam_pyspark.artifacts.store import FileWriter
from beam_pyspark.errors import BeamPySparkError

_LOGGER = logging.getLogger(__name__)

ArtifactInformation = beam_runner_api_pb2.ArtifactInformation
DependencySets = dict[str, list[ArtifactInformation]]

_FILE = common_urns.artifact_types.FILE.urn
_URL = common_urns.artifact_types.URL.urn
_EMBEDDED = common_urns.artifact_types.EMBEDDED.urn

# What we ask the client for, best first: files and embedded data end up in
# our store; a URL is kept as is (the runner fetches it itself).
_PREFERRED_URNS = (_FILE, _EMBEDDED, _URL)

# Chunks received but not yet written, over all streams. Beam's Java
# service allows 100 MB; measured here, a larger buffer did not stage faster
# (the writers set the pace once they fall behind), while it showed up
# byte for byte in the job server's resident memory, on top of gRPC's own
# receive buffers. 16 of Beam's 2 MB chunks absorb bursts just as well.
DEFAULT_MAX_BUFFERED_BYTES = 32 << 20

# gRPC trailers carry the details; a runaway exception message must not
# make them huge.
_MAX_DETAILS_CHARS = 2000


class ArtifactStagingError(BeamPySparkError):
  """Staging a job's artifacts failed, or has not finished."""


class UnknownStagingTokenError(ArtifactStagingError, LookupError):
  """No job is registered under this staging token."""


class ProtocolError(ArtifactStagingError):
  """The client sent a message the reverse retrieval protocol does not allow."""


# -- The protocol, without I/O ------------------------------------------------


class Phase(enum.Enum):
  START = 'start'  # start() not called yet
  RESOLVING = 'resolving'  # a resolve request is out; expecting its answer
  FETCHING = 'fetching'  # get requests are out; expecting chunks, in order
  FINISHED = 'finished'  # every environment resolved and fetched
  FAILED = 'failed'  # the client broke the protocol


@dataclasses.dataclass(frozen=True)
class SendRequest:
  request: beam_artifact_api_pb2.ArtifactRequestWrapper


@dataclasses.dataclass(frozen=True)
class KeepArtifact:
  """The runner can use this artifact as it is (a URL)."""
  environment: str
  index: int
  artifact: ArtifactInformation


@dataclasses.dataclass(frozen=True)
class StoreEmbedded:
  """The data came inside the artifact: store it without a fetch."""
  environment: str
  index: int
  artifact: ArtifactInformation
  data: bytes


@dataclasses.dataclass(frozen=True)
class BeginFetch:
  """The chunks that follow belong to this artifact."""
  environment: str
  index: int
  artifact: ArtifactInformation


@dataclasses.dataclass(frozen=True)
class FetchChunk:
  data: bytes


@dataclasses.dataclass(frozen=True)
class EndFetch:
  pass


@dataclasses.dataclass(frozen=True)
class Finished:
  pass


Instruction = Union[SendRequest, KeepArtifact, StoreEmbedded, BeginFetch,
                    FetchChunk, EndFetch, Finished]


class StagingProtocol:
  """The state machine of one reverse retrieval stream.

  ``start()`` and ``receive(response)`` return the instructions for the
  stream to carry out; ``index`` in them is the artifact's position in its
  environment's resolved list, so the rewritten dependencies keep the
  client's order. Environments without dependencies are not asked about.
  """
  def __init__(self, staging_token: str, dependency_sets: DependencySets):
    self.staging_token = staging_token
    self.phase = Phase.START
    self._dependency_sets = dependency_sets
    self._environments = collections.deque(
        env for env, deps in dependency_sets.items() if deps)
    self._environment: Optional[str] = None
    # Artifacts whose get request is out, in the order the client answers.
    self._pending: collections.deque[tuple[int, ArtifactInformation]] = (
        collections.deque())
    self._fetching = False  # inside an artifact's chunks (after its first)

  def describe(self) -> str:
    where = f', environment {self._environment!r}' if self._environment else ''
    return f'phase {self.phase.value}{where}'

  def start(self) -> list[Instruction]:
    if self.phase is not Phase.START:
      raise ProtocolError(f'start() in {self.describe()}')
    return self._next_environment()

  def receive(
      self, response: beam_artifact_api_pb2.ArtifactResponseWrapper
  ) -> list[Instruction]:
    try:
      kind = response.WhichOneof('response')
      if self.phase is Phase.RESOLVING and kind == 'resolve_artifact_response':
        return self._on_resolved(response.resolve_artifact_response)
      # Only the data and is_last matter for the end of an artifact; accept
      # a bare is_last as well as Beam's empty get_artifact_response.
      if self.phase is Phase.FETCHING and (
          kind == 'get_artifact_response' or
          (kind is None and response.is_last)):
        return self._on_chunk(response)
      raise ProtocolError(
          f'unexpected {kind or "empty"} message in {self.describe()}')
    except ProtocolError:
      self.phase = Phase.FAILED
      raise

  def _next_environment(self) -> list[Instruction]:
    if not self._environments:
      self._environment = None
      self.phase = Phase.FINISHED
      return [Finished()]
    self._environment = self._environments.popleft()
    self.phase = Phase.RESOLVING
    return [
        SendRequest(
            beam_artifact_api_pb2.ArtifactRequestWrapper(
                resolve_artifact=beam_artifact_api_pb2.ResolveArtifactsRequest(
                    artifacts=self._dependency_sets[self._environment],
                    preferred_urns=_PREFERRED_URNS)))
    ]

  def _on_resolved(
      self, resolved: beam_artifact_api_pb2.ResolveArtifactsResponse
  ) -> list[Instruction]:
    env = self._environment
    out: list[Instruction] = []
    for index, artifact in enumerate(resolved.replacements):
      if artifact.type_urn == _URL:
        out.append(KeepArtifact(env, index, artifact))
      elif artifact.type_urn == _EMBEDDED:
        try:
          data = beam_runner_api_pb2.EmbeddedFilePayload.FromString(
              artifact.type_payload).data
        except Exception as exn:  # pylint: disable=broad-except
          raise ProtocolError(
              f'artifact {index} of environment {env!r} has a malformed '
              f'embedded payload: {exn}') from exn
        out.append(StoreEmbedded(env, index, artifact, data))
      else:
        # Sending every get request at once saves a round trip per
        # artifact; the client answers them in order.
        self._pending.append((index, artifact))
        out.append(
            SendRequest(
                beam_artifact_api_pb2.ArtifactRequestWrapper(
                    get_artifact=beam_artifact_api_pb2.GetArtifactRequest(
                        artifact=artifact))))
    if self._pending:
      self.phase = Phase.FETCHING
    else:
      out.extend(self._next_environment())
    return out

  def _on_chunk(
      self, response: beam_artifact_api_pb2.ArtifactResponseWrapper
  ) -> list[Instruction]:
    out: list[Instruction] = []
    if not self._fetching:
      index, artifact = self._pending[0]
      out.append(BeginFetch(self._environment, index, artifact))
      self._fetching = True
    data = response.get_artifact_response.data
    if data:
      out.append(FetchChunk(data))
    if response.is_last:
      self._pending.popleft()
      self._fetching = False
      out.append(EndFetch())
      if not self._pending:
        out.extend(self._next_environment())
    return out


# -- One stream ---------------------------------------------------------------


_Slot = Union[ArtifactInformation, ArtifactSink]


@dataclasses.dataclass
class _Failure:
  code: grpc.StatusCode
  message: str
  cause: Optional[BaseException] = None


_DONE = object()


class _StreamAbandoned(Exception):
  """The stream failed elsewhere; the reader just stops."""


def _describe(exn: BaseException) -> str:
  return f'{type(exn).__name__}: {exn}'


class _StagingStream:
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
      service: 'ArtifactStagingService',
      staging_token: str,
      dependency_sets: DependencySets,
      responses: Iterator[beam_artifact_api_pb2.ArtifactResponseWrapper],
      context: Optional[grpc.ServicerContext]):
    self.staging_token = staging_token
    # Holds the stored files for this attempt; unique, so a failed attempt
    # or a later job with the same token never releases another's files.
    self.holder = f'{staging_token}#{uuid.uuid4().hex}'
    self._service = service
    self._store = service._store
    self._budget = service._budget
    self._protocol = StagingProtocol(staging_token, dependency_sets)
    self._responses = responses
    self._context = context
    self._outbox: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._sinks: list[ArtifactSink] = []  # _lock
    self._failure: Optional[_Failure] = None  # _lock
    self._completed = False  # _lock: staged; failures no longer apply
    self._cleanup_lock = threading.Lock()
    self._cleaned = False  # _cleanup_lock
    # Confined to the reader thread: env -> index -> artifact or sink.
    self._results: dict[str, dict[int, _Slot]] = {
        env: {} for env in dependency_sets
    }
    self._current: Optional[ArtifactSink] = None  # reader thread only
    self._started = time.monotonic()

  @property
  def failed(self) -> bool:
    return self._failure is not None

  def fail(self, failure: _Failure) -> None:
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
        if isinstance(item, _Failure):
          # Clean up before the client hears of it, so that when its call
          # fails no partial file is left behind.
          self.cleanup()
          abort(self._context, item.code, item.message[:_MAX_DETAILS_CHARS])
        yield item
    finally:
      if not finished:
        # gRPC stopped iterating (the client went away): let the reader
        # notice and clean up.
        self.fail(_Failure(grpc.StatusCode.CANCELLED, 'stream ended early'))

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
          _Failure(
              grpc.StatusCode.INVALID_ARGUMENT,
              f'Staging artifacts for {self.staging_token!r} failed: the '
              f'client broke the reverse retrieval protocol: {exn}',
              exn))
    except grpc.RpcError as exn:
      self.fail(
          _Failure(
              grpc.StatusCode.CANCELLED,
              f'Staging artifacts for {self.staging_token!r} ended: the '
              'client cancelled the call or disconnected',
              exn))
    except Exception as exn:  # pylint: disable=broad-except
      _LOGGER.exception('Staging artifacts for %r failed', self.staging_token)
      self.fail(
          _Failure(
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
          self._results[env][index] = artifact
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

  def _new_sink(
      self, env: str, artifact: ArtifactInformation) -> ArtifactSink:
    with self._lock:
      if self._failure is not None:
        raise _StreamAbandoned()
      sink = ArtifactSink(
          self._store, self._service._writers, self._budget, self.holder, env,
          artifact, self._on_sink_failure)
      self._sinks.append(sink)
      return sink

  def _feed(self, sink: ArtifactSink, data: bytes) -> None:
    if not data:
      return
    # Blocking here is the back-pressure: while we do not read, gRPC's flow
    # control stops the client.
    if not self._budget.acquire(len(data), lambda: self.failed):
      raise _StreamAbandoned()
    sink.put(data)

  def _on_sink_failure(self, sink: ArtifactSink, exn: BaseException) -> None:
    self.fail(
        _Failure(
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
    resolved: DependencySets = {}
    stored_bytes = 0
    stored_files = []
    for env, slots in self._results.items():
      resolved[env] = []
      for _, entry in sorted(slots.items()):
        if isinstance(entry, ArtifactSink):
          stored = entry.result.result()
          stored_bytes += stored.size
          stored_files.append(os.path.basename(stored.path))
          entry = ArtifactInformation(
              type_urn=_FILE,
              type_payload=beam_runner_api_pb2.ArtifactFilePayload(
                  path=stored.path, sha256=stored.sha256).SerializeToString(),
              role_urn=entry.artifact.role_urn,
              role_payload=entry.artifact.role_payload)
        resolved[env].append(entry)
    # Recorded before the job counts as staged, so that a restarted server
    # knows these files are in use. A failure from here on removes it again
    # (cleanup), as does the job's removal.
    self._service._record(self.staging_token, stored_files, resolved)
    with self._lock:
      if self._failure is not None:
        return
      self._completed = True
    if not self._service._staging_succeeded(self, resolved):
      # remove_job ran meanwhile: nobody will use these files. The handler
      # cleans up (releases them) before telling the client.
      failure = _Failure(
          grpc.StatusCode.ABORTED,
          f'Job {self.staging_token!r} was removed while its artifacts were '
          'being staged.')
      with self._lock:
        self._failure = failure
      self._outbox.put(failure)
      return
    _LOGGER.info(
        'Staged artifacts for %r: %d artifacts, %d stored (%d bytes) in '
        '%.1f s', self.staging_token, sum(map(len, resolved.values())),
        len(sinks), stored_bytes, time.monotonic() - self._started)
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
      self._service._unrecord(self.staging_token)
      self._service._staging_failed(self, failure)
      # A writer's traceback helps whoever runs the server; a client going
      # away or breaking the protocol needs none.
      internal = failure and failure.code is grpc.StatusCode.INTERNAL
      _LOGGER.warning(
          'Staging artifacts for %r failed (%s); removed %d stored files',
          self.staging_token, failure.message if failure else 'aborted',
          deleted, exc_info=failure.cause if internal else None)


# -- The service --------------------------------------------------------------


class StagingState(enum.Enum):
  REGISTERED = 'registered'  # waiting for the client's stream
  STAGING = 'staging'  # a stream is active
  STAGED = 'staged'
  FAILED = 'failed'  # the last stream failed; the client may try again


@dataclasses.dataclass
class Recovery:
  """What ``recover()`` found."""
  kept_jobs: list[str] = dataclasses.field(default_factory=list)
  forgotten_jobs: list[str] = dataclasses.field(default_factory=list)
  deleted_files: list[str] = dataclasses.field(default_factory=list)
  foreign_files: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Job:
  dependency_sets: DependencySets
  state: StagingState = StagingState.REGISTERED
  stream: Optional[_StagingStream] = None
  holder: Optional[str] = None  # of the stored files, once staged
  resolved: Optional[DependencySets] = None
  failure: Optional[str] = None


def _copy_artifacts(
    dependency_sets: Mapping[str, Sequence[ArtifactInformation]]
) -> DependencySets:
  # Protos are mutable; callers keep theirs and we keep ours.
  copied = {}
  for env, artifacts in dependency_sets.items():
    copied[env] = []
    for artifact in artifacts:
      copy = ArtifactInformation()
      copy.CopyFrom(artifact)
      copied[env].append(copy)
  return copied


class ArtifactStagingService(
    beam_artifact_api_pb2_grpc.ArtifactStagingServiceServicer):
  """Stages jobs' artifacts into a content-addressed directory.

  Args:
    root: the staging directory; every stored file is directly inside it.
    max_buffered_bytes: chunks received but not yet written, over all
      streams, at most (a single larger chunk is let through alone).
    writers: threads writing artifacts, shared by all streams.
    file_writer: opens a path for binary writing; ``open(path, 'xb')`` by
      default. Injectable so tests can simulate slow or failing disks.
    manifest_dir: where to record which files each staged job holds, so
      that a later process can ``recover()`` them; None keeps that in
      memory only (nothing survives a restart).
  """
  def __init__(
      self,
      root: str,
      max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
      writers: int = 4,
      file_writer: Optional[FileWriter] = None,
      manifest_dir: Optional[str] = None):
    if max_buffered_bytes <= 0:
      raise ValueError(
          f'max_buffered_bytes must be positive, not {max_buffered_bytes}')
    if writers <= 0:
      raise ValueError(f'writers must be positive, not {writers}')
    self._store = BlobStore(root, file_writer)
    self.root = self._store.root
    self._manifests = ManifestStore(manifest_dir) if manifest_dir else None
    self._budget = ByteBudget(max_buffered_bytes)
    self._writers = concurrent.futures.ThreadPoolExecutor(
        max_workers=writers, thread_name_prefix='artifact-writer')
    self._lock = threading.Lock()
    self._changed = threading.Condition(self._lock)
    self._jobs: dict[str, _Job] = {}  # _lock

  @property
  def buffered_bytes(self) -> int:
    """Bytes received and not yet written, now."""
    return self._budget.used

  @property
  def peak_buffered_bytes(self) -> int:
    """The most bytes ever buffered at once."""
    return self._budget.peak

  def register_job(
      self,
      staging_token: str,
      dependency_sets: Mapping[str, Sequence[ArtifactInformation]]) -> None:
    """Expects a client to stage these artifacts (env id -> dependencies)."""
    with self._lock:
      if staging_token in self._jobs:
        raise ValueError(
            f'Staging token {staging_token!r} is already registered')
      self._jobs[staging_token] = _Job(_copy_artifacts(dependency_sets))

  def is_staged(self, staging_token: str) -> bool:
    with self._lock:
      job = self._jobs.get(staging_token)
      return job is not None and job.state is StagingState.STAGED

  def wait_staged(
      self, staging_token: str, timeout: Optional[float] = None) -> bool:
    """True once staged; False on timeout; raises if staging failed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._changed:
      while True:
        job = self._job_locked(staging_token)
        if job.state is StagingState.STAGED:
          return True
        if job.state is StagingState.FAILED:
          raise ArtifactStagingError(job.failure)
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          return False
        self._changed.wait(remaining)

  def resolved_artifacts(self, staging_token: str) -> DependencySets:
    """The staged dependencies: FILE artifacts in the root, URLs as given."""
    with self._lock:
      job = self._job_locked(staging_token)
      if job.state is not StagingState.STAGED:
        raise ArtifactStagingError(
            f'The artifacts of {staging_token!r} are not staged '
            f'({job.state.value}' +
            (f': {job.failure})' if job.failure else ')'))
      return _copy_artifacts(job.resolved)

  def remove_job(self, staging_token: str) -> None:
    """Forgets the job; deletes its files unless another job uses them.

    Never blocks on a stream: a stream still staging is told to stop and
    removes its own files. Unknown tokens are ignored.
    """
    with self._changed:
      job = self._jobs.pop(staging_token, None)
      self._changed.notify_all()
    if job is None:
      return
    if job.stream is not None:
      job.stream.fail(
          _Failure(
              grpc.StatusCode.ABORTED,
              f'Job {staging_token!r} was removed while its artifacts were '
              'being staged.'))
    if job.holder is not None:
      deleted = self._store.release(job.holder)
      self._unrecord(staging_token)
      _LOGGER.info(
          'Removed staged artifacts of %r: %d files deleted', staging_token,
          deleted)

  def stages_url(self, url: str) -> bool:
    """Whether a staged job depends on this URL artifact (kept as a URL)."""
    with self._lock:
      for job in self._jobs.values():
        if job.state is StagingState.STAGED:
          for artifacts in job.resolved.values():
            for artifact in artifacts:
              if artifact.type_urn == _URL and url == (
                  beam_runner_api_pb2.ArtifactUrlPayload.FromString(
                      artifact.type_payload).url):
                return True
    return False

  def recover(self, retained_tokens: Iterable[str]) -> 'Recovery':
    """At start-up: takes back what earlier processes staged for jobs kept.

    The rule: a job's staged files live as long as its history entry (the
    job service removes the job when it drops the entry). So the jobs whose
    staging tokens are in ``retained_tokens`` (those the job store still
    lists) are staged again, holding their files, and are removed, files
    and all, when their entry is dropped later. Every other file of the
    root that this service named is deleted: files of jobs no longer
    retained, uploads a crash cut short, files committed just before a
    crash and never recorded. Call it before serving; it needs
    ``manifest_dir``.
    """
    if self._manifests is None:
      raise ArtifactStagingError(
          'recover() needs a manifest_dir: without one, nothing records '
          'which staged files a job holds.')
    retained = set(retained_tokens)
    recovery = Recovery()
    for manifest in self._manifests.load_all():
      token = manifest.staging_token
      if token not in retained:
        self._manifests.remove(token)
        recovery.forgotten_jobs.append(token)
        continue
      holder = f'{token}#recovered'
      missing = []
      for name in manifest.files:
        try:
          self._store.adopt(name, holder)
        except (OSError, ValueError) as exn:
          missing.append(f'{name} ({type(exn).__name__}: {exn})')
      job = _Job({}, holder=holder, resolved=manifest.resolved)
      if missing:
        job.state = StagingState.FAILED
        job.failure = (
            f'Staged files of {token!r} were missing at start-up: '
            + ', '.join(missing))
        _LOGGER.warning('%s', job.failure)
      else:
        job.state = StagingState.STAGED
      with self._lock:
        if token in self._jobs:
          raise ArtifactStagingError(
              f'recover() after {token!r} was registered: call it before '
              'serving.')
        self._jobs[token] = job
      recovery.kept_jobs.append(token)
    recovery.deleted_files, recovery.foreign_files = self._store.sweep()
    _LOGGER.info(
        'Recovered staged artifacts: kept %d jobs, forgot %d, deleted %d '
        'unreferenced files', len(recovery.kept_jobs),
        len(recovery.forgotten_jobs), len(recovery.deleted_files))
    if recovery.foreign_files:
      _LOGGER.warning(
          'Left alone in %s, not named by this service: %s', self.root,
          ', '.join(recovery.foreign_files))
    return recovery

  def close(self) -> None:
    """Stops the writer threads; streams still staging fail."""
    self._writers.shutdown(wait=False)

  def _job_locked(self, staging_token: str) -> _Job:
    job = self._jobs.get(staging_token)
    if job is None:
      raise UnknownStagingTokenError(
          f'Unknown staging token {staging_token!r}: no job was prepared '
          'with it, or it was removed.')
    return job

  # The gRPC service.

  def ReverseArtifactRetrievalService(
      self,
      responses: Iterator[beam_artifact_api_pb2.ArtifactResponseWrapper],
      context: Optional[grpc.ServicerContext] = None
  ) -> Iterator[beam_artifact_api_pb2.ArtifactRequestWrapper]:
    try:
      first = next(responses)
    except StopIteration:
      abort(
          context, grpc.StatusCode.INVALID_ARGUMENT,
          'The staging stream closed before sending its staging token.')
    except grpc.RpcError:
      return  # the client went away before saying anything
    stream = self._claim(first.staging_token, responses, context)
    yield from stream.serve()

  def _claim(
      self,
      staging_token: str,
      responses: Iterator[beam_artifact_api_pb2.ArtifactResponseWrapper],
      context: Optional[grpc.ServicerContext]) -> _StagingStream:
    with self._lock:
      job = self._jobs.get(staging_token)
      if job is None:
        code, message = grpc.StatusCode.NOT_FOUND, (
            f'Unknown staging token {staging_token!r}: no job was prepared '
            'with it, or it was removed. Stage artifacts with the token '
            'that Prepare returned.')
      elif job.state is StagingState.STAGING:
        code, message = grpc.StatusCode.FAILED_PRECONDITION, (
            f'The artifacts of {staging_token!r} are already being staged '
            'by another stream.')
      elif job.state is StagingState.STAGED:
        code, message = grpc.StatusCode.FAILED_PRECONDITION, (
            f'The artifacts of {staging_token!r} are already staged.')
      else:
        stream = _StagingStream(
            self, staging_token, job.dependency_sets, responses, context)
        job.state = StagingState.STAGING
        job.stream = stream
        job.failure = None
        _LOGGER.info(
            'Staging artifacts for %r: %d artifacts in %d environments',
            staging_token, sum(map(len, job.dependency_sets.values())),
            len(job.dependency_sets))
        return stream
    abort(context, code, message)

  # Called by streams.

  def _staging_succeeded(
      self, stream: _StagingStream, resolved: DependencySets) -> bool:
    with self._changed:
      job = self._jobs.get(stream.staging_token)
      if job is None or job.stream is not stream:
        return False
      job.state = StagingState.STAGED
      job.stream = None
      job.holder = stream.holder
      job.resolved = resolved
      self._changed.notify_all()
      return True

  def _record(
      self, staging_token: str, files: Sequence[str],
      resolved: DependencySets) -> None:
    if self._manifests is not None:
      self._manifests.write(staging_token, files, resolved)

  def _unrecord(self, staging_token: str) -> None:
    if self._manifests is not None:
      self._manifests.remove(staging_token)

  def _staging_failed(
      self, stream: _StagingStream, failure: Optional[_Failure]) -> None:
    with self._changed:
      job = self._jobs.get(stream.staging_token)
      if job is not None and job.stream is stream:
        job.state = StagingState.FAILED
        job.stream = None
        job.failure = failure.message if failure else 'staging was aborted'
        self._changed.notify_all()
