"""The reverse retrieval protocol of one staging stream, without I/O.

``StagingProtocol`` is the per-stream state machine: responses in,
instructions out. Its tests feed messages and compare instructions
(tests/test_artifacts.py). The stream that carries the instructions out is
``stream.StagingStream``; the service that owns jobs is ``staging``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
from typing import Callable
from typing import Optional
from typing import Union

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import BeamPySparkError

ArtifactInformation = beam_runner_api_pb2.ArtifactInformation
DependencySets = dict[str, list[ArtifactInformation]]

FILE_URN = common_urns.artifact_types.FILE.urn
URL_URN = common_urns.artifact_types.URL.urn
EMBEDDED_URN = common_urns.artifact_types.EMBEDDED.urn

# What we ask the client for, best first: files and embedded data end up in
# our store; a URL is kept as is (the runner fetches it itself).
_PREFERRED_URNS = (FILE_URN, EMBEDDED_URN, URL_URN)

# gRPC trailers carry the details; a runaway exception message must not
# make them huge.
_MAX_DETAILS_CHARS = 2000

_SHA256 = re.compile(r'^[0-9a-f]{64}$')


def declared_sha256(artifact: ArtifactInformation) -> Optional[str]:
  """The sha256 a FILE artifact's payload declares (Java's and Python's
  stagers fill it in), lower case; None when absent or not a digest."""
  if artifact.type_urn != FILE_URN:
    return None
  try:
    digest = beam_runner_api_pb2.ArtifactFilePayload.FromString(
        artifact.type_payload).sha256.lower()
  except Exception:  # pylint: disable=broad-except
    # Malformed: nothing to reuse; the fetch reports what is wrong.
    return None
  return digest if _SHA256.match(digest) else None


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
class ReuseStored:
  """The store already holds this content (claimed through ``reuse``):
  no bytes are asked for."""
  environment: str
  index: int
  artifact: ArtifactInformation
  sha256: str


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


Instruction = Union[SendRequest, KeepArtifact, StoreEmbedded, ReuseStored,
                    BeginFetch, FetchChunk, EndFetch, Finished]


class StagingProtocol:
  """The state machine of one reverse retrieval stream.

  ``start()`` and ``receive(response)`` return the instructions for the
  stream to carry out; ``index`` in them is the artifact's position in its
  environment's resolved list, so the rewritten dependencies keep the
  client's order. Every environment is asked about, also one without
  dependencies: a client may wait for its environment's resolve request
  before it ends the stream (Beam's TypeScript client waits for ever).

  ``reuse(sha256)`` is asked about each resolved FILE artifact that declares
  its sha256: True means the store holds that content and has taken a
  reference for this stream, so the artifact is not fetched (a Java job
  stages its whole classpath, the same jars job after job). Beam's own
  staging service has the hook (``getLocal()``) but always fetches.
  """
  def __init__(self, staging_token: str, dependency_sets: DependencySets,
               reuse: Callable[[str], bool] = lambda sha256: False):
    self.staging_token = staging_token
    self._reuse = reuse
    self.phase = Phase.START
    self._dependency_sets = dependency_sets
    self._environments = collections.deque(dependency_sets)
    self._environment: Optional[str] = None
    # Artifacts to fetch, in order; the first one's get request is out.
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
      if artifact.type_urn == URL_URN:
        out.append(KeepArtifact(env, index, artifact))
      elif artifact.type_urn == EMBEDDED_URN:
        try:
          data = beam_runner_api_pb2.EmbeddedFilePayload.FromString(
              artifact.type_payload).data
        except Exception as exn:  # pylint: disable=broad-except
          raise ProtocolError(
              f'artifact {index} of environment {env!r} has a malformed '
              f'embedded payload: {exn}') from exn
        out.append(StoreEmbedded(env, index, artifact, data))
      else:
        digest = declared_sha256(artifact)
        if digest is not None and self._reuse(digest):
          out.append(ReuseStored(env, index, artifact, digest))
        else:
          self._pending.append((index, artifact))
    if self._pending:
      self.phase = Phase.FETCHING
      out.append(self._get_request())
    else:
      out.extend(self._next_environment())
    return out

  def _get_request(self) -> SendRequest:
    """The get request of the first pending artifact. One at a time, as
    Beam's own staging service asks: the protocol has no artifact id in its
    chunks, and Beam's TypeScript client answers requests concurrently (an
    async handler per request), so two outstanding requests interleaved the
    chunks of two files into both."""
    _, artifact = self._pending[0]
    return SendRequest(
        beam_artifact_api_pb2.ArtifactRequestWrapper(
            get_artifact=beam_artifact_api_pb2.GetArtifactRequest(
                artifact=artifact)))

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
      if self._pending:
        out.append(self._get_request())
      else:
        out.extend(self._next_environment())
    return out
