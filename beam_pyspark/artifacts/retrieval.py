"""Artifact retrieval: serves staged artifacts to SDK workers.

Only files inside the staging root are served: a FILE artifact's path comes
from whoever calls, so a path that resolves (symbolic links included) outside
the root is refused, and this service can never be used to read the runner's
other files.

URL artifacts are kept as URLs at staging and fetched when a worker asks
(``open_url``: http(s) with urllib, file:// and plain paths locally, other
schemes such as gs:// or s3:// with Beam's FileSystems). The same reasoning
applies: a caller names the URL, so the job server serves only URLs that a
staged job depends on (``url_allowed``), never an arbitrary one from inside
its network.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import BinaryIO
from typing import Callable
from typing import Iterator
from typing import NoReturn
from typing import Optional
from typing import Sequence

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import BeamPySparkError

ArtifactInformation = beam_runner_api_pb2.ArtifactInformation
Resolver = Callable[[Sequence[ArtifactInformation]], list[ArtifactInformation]]

# Beam's own default; well under gRPC's 4 MB default message limit.
DEFAULT_CHUNK_SIZE = 2 << 20

# Seconds to wait on an http(s) server (connect, and each read).
URL_TIMEOUT = 60.0

_URLLIB_SCHEMES = ('http', 'https', 'ftp')


def open_url(url: str, timeout: float = URL_TIMEOUT) -> BinaryIO:
  """Opens a URL artifact's content for reading, uncompressed.

  http, https and ftp go through urllib; file:// (local host only) and plain
  paths are local files; anything else goes to Beam's FileSystems (gs://,
  s3://, hdfs://... when their extras are installed). Raises what the
  underlying opener raises; the retrieval service turns it into an error
  naming the URL.
  """
  parts = urllib.parse.urlsplit(url)
  scheme = parts.scheme.lower()
  if scheme in _URLLIB_SCHEMES:
    return urllib.request.urlopen(url, timeout=timeout)
  if scheme == 'file':
    if parts.netloc not in ('', 'localhost'):
      raise ValueError(
          f'file URL names host {parts.netloc!r}; only local files '
          '(file:///path) can be read')
    return open(urllib.request.url2pathname(parts.path), 'rb')
  from apache_beam.io.filesystem import CompressionTypes
  from apache_beam.io.filesystems import FileSystems
  # UNCOMPRESSED: an artifact is served byte for byte, never decompressed
  # because its name ends in .gz.
  return FileSystems.open(url, compression_type=CompressionTypes.UNCOMPRESSED)


def _url_error_code(exn: BaseException) -> grpc.StatusCode:
  if isinstance(exn, urllib.error.HTTPError):
    if exn.code in (404, 410):
      return grpc.StatusCode.NOT_FOUND
    if exn.code in (401, 403):
      return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.UNAVAILABLE
  if isinstance(exn, FileNotFoundError):
    return grpc.StatusCode.NOT_FOUND
  if isinstance(exn, PermissionError):
    return grpc.StatusCode.PERMISSION_DENIED
  if isinstance(exn, ValueError):
    return grpc.StatusCode.INVALID_ARGUMENT
  return grpc.StatusCode.UNAVAILABLE


# A status's details travel in gRPC trailers, which a client refuses past
# its metadata limit (8 KiB by default, every header counted): an error
# naming 20,000 environments was 7 MB, and the client saw only that its
# trailers were too big. Texts past this are cut, saying how much.
MAX_DETAILS_BYTES = 4096


def bounded(text: str, limit: int = MAX_DETAILS_BYTES) -> str:
  """``text`` in at most ``limit`` UTF-8 bytes: its start, and how many
  bytes were cut."""
  data = text.encode('utf-8', 'replace')
  if len(data) <= limit:
    return text
  note = f' [... {len(data)} bytes in all; the rest was cut]'
  head = data[:max(0, limit - len(note.encode('utf-8')))]
  return head.decode('utf-8', 'ignore') + note


class ArtifactServiceError(BeamPySparkError):
  """A refused artifact call, when a service is used without gRPC."""
  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code


def abort(
    context: Optional[grpc.ServicerContext], code: grpc.StatusCode,
    message: str) -> NoReturn:
  """Ends the call with code and message.

  Beam calls these servicers in-process too, without a context (as its own
  offer_artifacts and resolve_artifacts allow); the error is then raised.
  """
  message = bounded(message)
  if context is None:
    raise ArtifactServiceError(code, message)
  context.abort(code, message)
  raise AssertionError('context.abort returned')  # it always raises


class ArtifactRetrievalService(
    beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceServicer):
  """Serves the artifacts of a staging root.

  Args:
    root: the staging directory (ArtifactStagingService's root).
    chunk_size: bytes per GetArtifact message.
    resolver: maps requested artifacts to servable ones in
      ResolveArtifacts; by default they are returned as given, which suits
      pipelines whose dependencies the job service already rewrote to the
      staged FILE artifacts.
    url_opener: opens URL artifacts (``open_url`` does). None by default:
      URL artifacts are then refused.
    url_allowed: which URLs may be opened; required with ``url_opener``
      (the job server passes its staging service's ``stages_url``). Fetching
      any URL a caller names, from inside the runner's network, must be a
      decision, not a default.
  """
  def __init__(
      self,
      root: str,
      chunk_size: int = DEFAULT_CHUNK_SIZE,
      resolver: Optional[Resolver] = None,
      url_opener: Optional[Callable[[str], BinaryIO]] = None,
      url_allowed: Optional[Callable[[str], bool]] = None):
    if chunk_size <= 0:
      raise ValueError(f'chunk_size must be positive, not {chunk_size}')
    if url_opener is not None and url_allowed is None:
      raise ValueError(
          'url_opener needs url_allowed: say which URLs may be fetched')
    self.root = os.path.realpath(root)
    self._chunk_size = chunk_size
    self._resolver = resolver
    self._url_opener = url_opener
    self._url_allowed = url_allowed

  def ResolveArtifacts(
      self,
      request: beam_artifact_api_pb2.ResolveArtifactsRequest,
      context: Optional[grpc.ServicerContext] = None
  ) -> beam_artifact_api_pb2.ResolveArtifactsResponse:
    artifacts = list(request.artifacts)
    if self._resolver is not None:
      artifacts = self._resolver(artifacts)
    return beam_artifact_api_pb2.ResolveArtifactsResponse(
        replacements=artifacts)

  def GetArtifact(
      self,
      request: beam_artifact_api_pb2.GetArtifactRequest,
      context: Optional[grpc.ServicerContext] = None
  ) -> Iterator[beam_artifact_api_pb2.GetArtifactResponse]:
    artifact = request.artifact
    urn = artifact.type_urn
    if urn == common_urns.artifact_types.FILE.urn:
      payload = self._parse(
          artifact, beam_runner_api_pb2.ArtifactFilePayload, context)
      handle = self._open_in_root(payload.path, context)
    elif urn == common_urns.artifact_types.EMBEDDED.urn:
      data = self._parse(
          artifact, beam_runner_api_pb2.EmbeddedFilePayload, context).data
      for start in range(0, len(data), self._chunk_size):
        yield beam_artifact_api_pb2.GetArtifactResponse(
            data=data[start:start + self._chunk_size])
      return
    elif urn == common_urns.artifact_types.URL.urn and self._url_opener:
      payload = self._parse(
          artifact, beam_runner_api_pb2.ArtifactUrlPayload, context)
      yield from self._serve_url(payload.url, payload.sha256, context)
      return
    else:
      abort(
          context,
          grpc.StatusCode.INVALID_ARGUMENT,
          f'Cannot serve artifacts of type {urn!r}: this service serves '
          'FILE artifacts inside its staging root' +
          (', URL artifacts of staged jobs' if self._url_opener else '') +
          ' and EMBEDDED data.')
    with handle:
      while True:
        chunk = handle.read(self._chunk_size)
        if not chunk:
          break
        yield beam_artifact_api_pb2.GetArtifactResponse(data=chunk)

  def _serve_url(
      self, url: str, sha256: str, context: Optional[grpc.ServicerContext]
  ) -> Iterator[beam_artifact_api_pb2.GetArtifactResponse]:
    if not self._url_allowed(url):
      abort(
          context,
          grpc.StatusCode.PERMISSION_DENIED,
          f'URL artifact {url!r} is not a dependency of any staged job '
          'that this server may fetch (its URL allowlist); only those are '
          'fetched.')
    try:
      handle = self._url_opener(url)
    except Exception as exn:  # pylint: disable=broad-except
      abort(
          context,
          _url_error_code(exn),
          f'Cannot fetch URL artifact {url!r}: {type(exn).__name__}: {exn}')
    hasher = hashlib.sha256()
    size = 0
    with handle:
      while True:
        try:
          chunk = handle.read(self._chunk_size)
        except Exception as exn:  # pylint: disable=broad-except
          abort(
              context,
              grpc.StatusCode.UNAVAILABLE,
              f'Fetching URL artifact {url!r} failed after {size} bytes: '
              f'{type(exn).__name__}: {exn}')
        if not chunk:
          break
        size += len(chunk)
        hasher.update(chunk)
        yield beam_artifact_api_pb2.GetArtifactResponse(data=chunk)
    if sha256 and hasher.hexdigest() != sha256.lower():
      # The bytes already went out; the error tells the worker not to use
      # them.
      abort(
          context,
          grpc.StatusCode.DATA_LOSS,
          f'URL artifact {url!r} has sha256 {hasher.hexdigest()}, not the '
          f'{sha256} its payload declares ({size} bytes read).')

  @staticmethod
  def _parse(artifact, payload_type, context):
    try:
      return payload_type.FromString(artifact.type_payload)
    except Exception as exn:  # pylint: disable=broad-except
      abort(
          context,
          grpc.StatusCode.INVALID_ARGUMENT,
          f'Malformed {payload_type.__name__} in artifact of type '
          f'{artifact.type_urn!r}: {exn}')

  def _open_in_root(
      self, path: str,
      context: Optional[grpc.ServicerContext]) -> BinaryIO:
    try:
      # Relative paths are relative to the root; realpath resolves '..' and
      # symbolic links, so the check below sees where the bytes really are.
      real = os.path.realpath(os.path.join(self.root, path))
    except ValueError as exn:  # e.g. an embedded NUL
      abort(
          context,
          grpc.StatusCode.INVALID_ARGUMENT,
          f'Invalid artifact path {path!r}: {exn}')
    if not path or real == self.root or os.path.commonpath(
        [self.root, real]) != self.root:
      abort(
          context,
          grpc.StatusCode.PERMISSION_DENIED,
          f'Artifact path {path!r} is outside the staging root {self.root}; '
          'only staged artifacts are served.')
    try:
      return open(real, 'rb')
    except FileNotFoundError:
      abort(
          context,
          grpc.StatusCode.NOT_FOUND,
          f'Artifact {path!r} is not (or no longer) staged.')
    except OSError as exn:
      abort(
          context,
          grpc.StatusCode.FAILED_PRECONDITION,
          f'Cannot read artifact {path!r}: {type(exn).__name__}: {exn}')
