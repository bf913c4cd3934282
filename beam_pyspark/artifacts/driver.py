"""The driver's artifact server: executors fetch a job's files from it.

A job's staged dependencies used to travel to executors in one Spark
broadcast, read whole into the driver's Python first, then pickled into
its JVM: a 1 GiB dependency took the job server from 280 to 1305 MiB and
killed the driver's JVM (``OutOfMemoryError: Java heap space``; issue 26).
Instead the driver serves the files where they are (the job server's
artifact store, PySparkRunner's staging directory, a URL artifact
downloaded to a temporary file), and each executor streams what its host
lacks to disk, 2 MiB at a time, checking the digest as it goes
(``worker.setup.artifacts``). Nothing holds a whole file in memory.

It is Beam's ``ArtifactRetrievalService`` (``GetArtifact`` of a FILE
artifact by path), so the same server also feeds the Fn API's artifact
retrieval of other SDKs' PROCESS harnesses on executors
(``worker.harnesses.servers``): those used to read the job server's own
paths, which only an executor on its disk could.

Who may read what: each job registers its files and gets a token, a
random 256-bit secret that travels to executors inside the job's tasks
(as its broadcasts did); a request must carry it (gRPC metadata
``TOKEN_HEADER``) and may read only the files registered under it, until
the job ends and unregisters them. The server listens where executors
reach the driver (``spark.driver.host``; loopback on a local master), as
Spark's own driver ports do, on a free port unless the Spark setting
``spark.beam.artifactServer.port`` names one (a cluster whose firewall
opens only the driver's configured ports).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from concurrent import futures
from typing import Iterable
from typing import Iterator
from typing import Optional

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

_LOGGER = logging.getLogger(__name__)

TOKEN_HEADER = 'beam-pyspark-artifact-token'
CHUNK_BYTES = 2 << 20
# Concurrent GetArtifact streams; more wait (an executor asks for a file
# once per host and set of dependencies).
WORKERS = 8


class DriverArtifactServer(
    beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceServicer):
  """Serves registered files to whoever holds their job's token."""
  def __init__(self, bind_host: str, advertised_host: str, port: int = 0):
    self._lock = threading.Lock()
    self._files: dict[str, frozenset[str]] = {}  # token -> real paths
    # SO_REUSEPORT off (gRPC sets it by default): a fixed
    # spark.beam.artifactServer.port held by another driver must fail the
    # bind, not be shared with it.
    self._server = grpc.server(
        futures.ThreadPoolExecutor(
            WORKERS, thread_name_prefix='beam-pyspark-artifacts'),
        options=(('grpc.so_reuseport', 0), ))
    beam_artifact_api_pb2_grpc.add_ArtifactRetrievalServiceServicer_to_server(
        self, self._server)
    bound = _add_port(self._server, bind_host, port)
    if not bound:
      # The driver's name may not resolve to an address of this host (a
      # service name): every interface, as Spark's own ports then do.
      _LOGGER.warning('The driver\'s artifact server cannot listen on %s; '
                      'it listens on every interface (a job\'s token is '
                      'still needed to read its files)', bind_host)
      bound = _add_port(self._server, '0.0.0.0', port)
    if not bound:
      raise OSError(f'The driver\'s artifact server cannot listen on port '
                    f'{port} (spark.beam.artifactServer.port)')
    host = f'[{advertised_host}]' if ':' in advertised_host else (
        advertised_host)
    self.endpoint = f'{host}:{bound}'
    self._server.start()

  def stop(self) -> None:
    self._server.stop(0)

  def register(self, paths: Iterable[str]) -> str:
    """Serves these files under a new token, returned."""
    token = secrets.token_hex(32)
    with self._lock:
      self._files[token] = frozenset(os.path.realpath(p) for p in paths)
    return token

  def unregister(self, token: str) -> None:
    with self._lock:
      self._files.pop(token, None)

  # -- ArtifactRetrievalService -------------------------------------------------

  def ResolveArtifacts(self, request, context=None):
    return beam_artifact_api_pb2.ResolveArtifactsResponse(
        replacements=request.artifacts)

  def GetArtifact(
      self, request: beam_artifact_api_pb2.GetArtifactRequest,
      context: grpc.ServicerContext
  ) -> Iterator[beam_artifact_api_pb2.GetArtifactResponse]:
    artifact = request.artifact
    if artifact.type_urn != common_urns.artifact_types.FILE.urn:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                    'The driver serves FILE artifacts only.')
    path = beam_runner_api_pb2.ArtifactFilePayload.FromString(
        artifact.type_payload).path
    token = dict(context.invocation_metadata()).get(TOKEN_HEADER, '')
    with self._lock:
      allowed = self._files.get(token)
    if allowed is None or os.path.realpath(path) not in allowed:
      context.abort(
          grpc.StatusCode.PERMISSION_DENIED,
          f'{path!r} is not an artifact of a running job that this caller '
          'belongs to.')
    try:
      handle = open(path, 'rb')
    except OSError as exn:
      context.abort(grpc.StatusCode.NOT_FOUND,
                    f'Cannot read the artifact {path!r} on the driver: {exn}')
    with handle:
      while chunk := handle.read(CHUNK_BYTES):
        yield beam_artifact_api_pb2.GetArtifactResponse(data=chunk)


def _add_port(server, host: str, port: int) -> int:
  """The port bound on host (0: could not)."""
  address = f'[{host}]' if ':' in host else host
  try:
    return server.add_insecure_port(f'{address}:{port}')
  except RuntimeError:  # newer gRPC raises where older returned 0
    return 0


_server_lock = threading.Lock()
_server: Optional[DriverArtifactServer] = None


def driver_server(bind_host: str, advertised_host: str, port: int = 0
                  ) -> DriverArtifactServer:
  """This process's server, started on first use (one per driver)."""
  global _server
  with _server_lock:
    if _server is None:
      _server = DriverArtifactServer(bind_host, advertised_host, port)
      _LOGGER.info('Executors fetch staged artifacts from %s',
                   _server.endpoint)
    return _server
