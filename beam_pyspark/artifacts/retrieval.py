"""Artifact retrieval: serves staged artifacts to SDK workers.

Only files inside the staging root are served: a FILE artifact's path comes
from whoever calls, so a path that resolves (symbolic links included) outside
the root is refused, and this service can never be used to read the runner's
other files.
"""

from __future__ import annotations

import os
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
    url_opener: opens URL artifacts (e.g. ``urllib.request.urlopen``). None
      by default: fetching any URL a caller names, from inside the
      runner's network, is a decision for whoever deploys it.
  """
  def __init__(
      self,
      root: str,
      chunk_size: int = DEFAULT_CHUNK_SIZE,
      resolver: Optional[Resolver] = None,
      url_opener: Optional[Callable[[str], BinaryIO]] = None):
    if chunk_size <= 0:
      raise ValueError(f'chunk_size must be positive, not {chunk_size}')
    self.root = os.path.realpath(root)
    self._chunk_size = chunk_size
    self._resolver = resolver
    self._url_opener = url_opener

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
      url = self._parse(
          artifact, beam_runner_api_pb2.ArtifactUrlPayload, context).url
      handle = self._url_opener(url)
    else:
      abort(
          context,
          grpc.StatusCode.INVALID_ARGUMENT,
          f'Cannot serve artifacts of type {urn!r}: this service serves '
          'FILE artifacts inside its staging root and EMBEDDED data.')
    with handle:
      while True:
        chunk = handle.read(self._chunk_size)
        if not chunk:
          break
        yield beam_artifact_api_pb2.GetArtifactResponse(data=chunk)

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
