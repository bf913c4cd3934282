"""Inside executors: a job's artifacts, fetched from the driver.

The driver serves each job's files (``artifacts.driver``) to holders of
the job's token; an ``ArtifactSource`` (the driver's address and the
token, which travel in the job's tasks) streams one to a file, checking
its size and digest as it comes, or hands out a reader over it. Nothing
holds a whole file in memory.

Two users: the job's staged Python dependencies, installed once per host
(``dependencies``), and the Fn API's artifact retrieval that the Python
worker serves to a PROCESS harness of another SDK (``reader``, which
``worker.harnesses.servers`` gives Beam's retrieval service): the
harness asks for the job server's paths, and gets them from the driver
whatever host it runs on.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import threading
from typing import BinaryIO
from typing import Callable
from typing import Mapping
from typing import Optional

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.worker.setup import dependencies as deps

# The driver's artifacts.driver.TOKEN_HEADER (worker/ does not import
# artifacts/: the executors' side knows only the protocol).
TOKEN_HEADER = 'beam-pyspark-artifact-token'
# Jobs whose sources a Python worker remembers (for harnesses it starts).
KEPT_SOURCES = 64


@dataclasses.dataclass(frozen=True)
class ArtifactSource:
  """Where a job's artifacts are served, and its token; picklable."""
  endpoint: str
  token: str
  # Driver paths this source serves (those a PROCESS harness may ask for).
  paths: frozenset = frozenset()

  def _chunks(self, path: str):
    channel = _channel(self.endpoint)
    stub = beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceStub(channel)
    request = beam_artifact_api_pb2.GetArtifactRequest(
        artifact=beam_runner_api_pb2.ArtifactInformation(
            type_urn=common_urns.artifact_types.FILE.urn,
            type_payload=beam_runner_api_pb2.ArtifactFilePayload(
                path=path).SerializeToString()))
    for response in stub.GetArtifact(
        request, metadata=((TOKEN_HEADER, self.token),)):
      yield response.data

  def fetcher(self, paths: Mapping[str, str]) -> deps.Fetch:
    """A dependencies.Fetch of the staged files at these driver paths
    (staged name -> path): each streamed to its file and checked."""
    def fetch(f: deps.StagedFile, dest: str) -> None:
      try:
        deps.write_verified(self._chunks(paths[f.name]), dest, f)
      except grpc.RpcError as exn:
        raise PipelineExecutionError(
            f'Could not fetch the staged dependency {f.name!r} from the '
            f'driver at {self.endpoint}: {exn.code().name}: '
            f'{exn.details()}') from None
    return fetch

  def open(self, path: str) -> BinaryIO:
    """A reader over the driver's ``path``, chunk by chunk."""
    return io.BufferedReader(_ChunkStream(self._chunks(path)),
                             buffer_size=1 << 20)


class _ChunkStream(io.RawIOBase):
  def __init__(self, chunks):
    self._chunks = iter(chunks)
    self._pending = b''

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    while not self._pending:
      try:
        self._pending = next(self._chunks)
      except StopIteration:
        return 0
    n = min(len(buffer), len(self._pending))
    buffer[:n] = self._pending[:n]
    self._pending = self._pending[n:]
    return n


_channels_lock = threading.Lock()
_channels: dict[tuple[int, str], grpc.Channel] = {}


def _channel(endpoint: str) -> grpc.Channel:
  """One channel per driver endpoint and process (Spark forks its Python
  workers: a channel is never shared across a fork)."""
  key = (os.getpid(), endpoint)
  with _channels_lock:
    channel = _channels.get(key)
    if channel is None:
      channel = _channels[key] = grpc.insecure_channel(endpoint)
    return channel


# -- the Fn API's artifact retrieval, per job -----------------------------------

_sources_lock = threading.Lock()
_sources: collections.OrderedDict = collections.OrderedDict()


def register(job_id: str, source: Optional[ArtifactSource]) -> None:
  """The job's source, for the PROCESS harnesses this worker starts."""
  if source is None:
    return
  with _sources_lock:
    _sources[job_id] = source
    _sources.move_to_end(job_id)
    while len(_sources) > KEPT_SOURCES:
      _sources.popitem(last=False)


def reader(job_id: str, fallback: Callable[[str], BinaryIO]
           ) -> Callable[[str], BinaryIO]:
  """Opens an artifact a harness of ``job_id`` asks for by path: from the
  driver when the job's source serves that path, else ``fallback`` (Beam's
  FileSystems: a path on this host, or a URL)."""
  def open_artifact(path: str) -> BinaryIO:
    with _sources_lock:
      source = _sources.get(job_id)
    if source is not None and path in source.paths:
      return source.open(path)
    return fallback(path)
  return open_artifact
