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

* ``protocol.StagingProtocol`` is the per-stream state machine, with no I/O:
  responses in, instructions out. Its tests feed messages and compare
  instructions.
* ``stream.StagingStream`` does the I/O of one stream: a reader thread
  consumes the client's messages and hands chunks to ``ArtifactSink``s,
  gRPC's handler thread sends requests and, on any error, the root cause.
  It reaches this service only through its ``StagingHost`` interface.
* Chunks are written by a bounded pool of writer threads, several artifacts
  in parallel, and the bytes received but not yet written are bounded by one
  ``ByteBudget`` shared by all streams: when it is used up the reader stops
  reading, gRPC flow control stops the client, and a slow disk throttles the
  client instead of filling memory.

This module is the service: jobs, their staging state, recovery.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import logging
import threading
import time
from typing import Iterable
from typing import Iterator
from typing import Mapping
from typing import Optional
from typing import Sequence

import grpc
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.artifacts.manifests import ManifestStore
from beam_pyspark.artifacts.retrieval import abort
from beam_pyspark.artifacts.store import BlobStore
from beam_pyspark.artifacts.store import ByteBudget
from beam_pyspark.artifacts.store import FileWriter
from beam_pyspark.artifacts.protocol import ArtifactInformation
from beam_pyspark.artifacts.protocol import ArtifactStagingError
from beam_pyspark.artifacts.protocol import DependencySets
from beam_pyspark.artifacts.protocol import UnknownStagingTokenError
from beam_pyspark.artifacts.protocol import URL_URN
from beam_pyspark.artifacts.stream import Failure
from beam_pyspark.artifacts.urls import UrlPolicy
from beam_pyspark.artifacts.stream import StagingStream

_LOGGER = logging.getLogger(__name__)

# Chunks received but not yet written, over all streams. Beam's Java
# service allows 100 MB; measured here, a larger buffer did not stage faster
# (the writers set the pace once they fall behind), while it showed up
# byte for byte in the job server's resident memory, on top of gRPC's own
# receive buffers. 16 of Beam's 2 MB chunks absorb bursts just as well.
DEFAULT_MAX_BUFFERED_BYTES = 32 << 20
# One artifact's size, at most: its stream is refused past it, naming the
# limit and the flag. Executors stream each file to disk from the driver
# (artifacts.driver), so memory does not bound it; the disks of the
# artifact store and of every executor host do.
DEFAULT_MAX_ARTIFACT_BYTES = 4 << 30



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
  stream: Optional[StagingStream] = None
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
    max_artifact_bytes: one artifact's size at most; a stream sending a
      larger one fails (RESOURCE_EXHAUSTED), its files removed.
    writers: threads writing artifacts, shared by all streams.
    file_writer: opens a path for binary writing; ``open(path, 'xb')`` by
      default. Injectable so tests can simulate slow or failing disks.
    manifest_dir: where to record which files each staged job holds, so
      that a later process can ``recover()`` them; None keeps that in
      memory only (nothing survives a restart).
    url_policy: the URL artifacts a client may resolve an artifact to
      (kept as URLs, fetched by the job server later); others fail the
      stream. None keeps any URL: for a service whose URLs nobody fetches.
  """
  def __init__(
      self,
      root: str,
      max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
      writers: int = 4,
      max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
      file_writer: Optional[FileWriter] = None,
      manifest_dir: Optional[str] = None,
      url_policy: Optional[UrlPolicy] = None):
    if max_buffered_bytes <= 0:
      raise ValueError(
          f'max_buffered_bytes must be positive, not {max_buffered_bytes}')
    if writers <= 0:
      raise ValueError(f'writers must be positive, not {writers}')
    self.store = BlobStore(root, file_writer)
    self.root = self.store.root
    self._manifests = ManifestStore(manifest_dir) if manifest_dir else None
    self.budget = ByteBudget(max_buffered_bytes)
    self.max_artifact_bytes = max_artifact_bytes
    self.url_policy = url_policy
    self.writers = concurrent.futures.ThreadPoolExecutor(
        max_workers=writers, thread_name_prefix='artifact-writer')
    self._lock = threading.Lock()
    self._changed = threading.Condition(self._lock)
    self._jobs: dict[str, _Job] = {}  # _lock

  @property
  def buffered_bytes(self) -> int:
    """Bytes received and not yet written, now."""
    return self.budget.used

  @property
  def peak_buffered_bytes(self) -> int:
    """The most bytes ever buffered at once."""
    return self.budget.peak

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
          Failure(
              grpc.StatusCode.ABORTED,
              f'Job {staging_token!r} was removed while its artifacts were '
              'being staged.'))
    if job.holder is not None:
      deleted = self.store.release(job.holder)
      self.forget_staged(staging_token)
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
              if artifact.type_urn == URL_URN and url == (
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
          self.store.adopt(name, holder)
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
    recovery.deleted_files, recovery.foreign_files = self.store.sweep()
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
    self.writers.shutdown(wait=False)

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
      context: Optional[grpc.ServicerContext]) -> StagingStream:
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
        stream = StagingStream(
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

  # The StagingHost interface, for streams.

  def staging_succeeded(
      self, stream: StagingStream, resolved: DependencySets) -> bool:
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

  def record_staged(
      self, staging_token: str, files: Sequence[str],
      resolved: DependencySets) -> None:
    if self._manifests is not None:
      self._manifests.write(staging_token, files, resolved)

  def forget_staged(self, staging_token: str) -> None:
    if self._manifests is not None:
      self._manifests.remove(staging_token)

  def staging_failed(
      self, stream: StagingStream, failure: Optional[Failure]) -> None:
    with self._changed:
      job = self._jobs.get(stream.staging_token)
      if job is not None and job.stream is stream:
        job.state = StagingState.FAILED
        job.stream = None
        job.failure = failure.message if failure else 'staging was aborted'
        self._changed.notify_all()
