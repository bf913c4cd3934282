"""The job server: Job API, artifact staging and retrieval, expansion."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import threading
import time
from concurrent import futures
from typing import Callable
from typing import Optional

import grpc
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_expansion_api_pb2_grpc
from apache_beam.portability.api import beam_job_api_pb2_grpc

from beam_pyspark.artifacts.staging import DEFAULT_MAX_ARTIFACT_BYTES
from beam_pyspark.artifacts.staging import DEFAULT_MAX_BUFFERED_BYTES
from beam_pyspark.artifacts.urls import UrlPolicy
from beam_pyspark.jobservice.health import health_handler
from beam_pyspark.jobservice.recovery import StreamingRecovery
from beam_pyspark.jobservice.jobs import DEFAULT_MAX_PREPARATIONS
from beam_pyspark.jobservice.jobs import DEFAULT_PREPARATION_TIMEOUT_SECS
from beam_pyspark.jobservice.service import DEFAULT_MAX_INVOCATION_HISTORY
from beam_pyspark.jobservice.service import JobService
from beam_pyspark.jobservice.store import JobStore
from beam_pyspark.planning.environments import parse_all as parse_overrides

_LOGGER = logging.getLogger(__name__)


# gRPC sets SO_REUSEPORT on its listening sockets by default: a second
# server started with the same default binds the port a first one holds,
# without a word, and the kernel then shares connections between the two
# (two job servers on 8099 each got half of the clients). Off, a port held
# by anyone fails the bind.
EXCLUSIVE_PORTS = (('grpc.so_reuseport', 0), )


def grpc_server(max_workers: int, **kwargs) -> grpc.Server:
  """A gRPC server whose ports are its own (EXCLUSIVE_PORTS)."""
  return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                     options=EXCLUSIVE_PORTS, **kwargs)


class PortInUseError(RuntimeError):
  """A port the job server was told to listen on is not free."""


def _why_not_bound(host: str, port: int) -> str:
  """What the OS says binding (host, port) would do: gRPC's own error
  names no cause."""
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except OSError as exn:
    return f'{host!r} does not resolve ({exn})'
  for family, kind, proto, _, address in infos:
    with socket.socket(family, kind, proto) as probe:
      try:
        probe.bind(address)
      except OSError as exn:
        if exn.errno == errno.EADDRINUSE:
          return f'port {port} is in use (by another process)'
        return f'{exn.strerror or exn}'
  return 'gRPC could not bind it'


def bind_port(server, host: str, port: int, flag: str = '') -> int:
  """Opens ``port`` (0: a free one) of ``host`` on the gRPC ``server``;
  raises PortInUseError naming the port and ``flag`` if it cannot.

  gRPC binds ``localhost:0`` as two addresses, [::1] and 127.0.0.1, with
  the port it found free on the first; when another process holds that
  port on the second, it binds only one and says so in a log line, and a
  client of ``localhost`` may reach the other process (Beam's Go SDK timed
  out staging artifacts so). For ``localhost`` the IPv4 address comes
  first, then [::1] on the same port where it is free (clients of
  ``localhost`` fall back to 127.0.0.1 where [::1] refuses)."""
  first = '127.0.0.1' if host == 'localhost' else host
  try:
    bound = server.add_insecure_port(f'{first}:{port}')
  except RuntimeError as exn:
    why = _why_not_bound(first, port)
    raise PortInUseError(
        f'Cannot listen on {host}:{port}{f" ({flag})" if flag else ""}: '
        f'{why}. Stop what holds it, or give {flag or "the server"} another '
        'port (0 picks a free one).') from exn
  if host == 'localhost':
    try:
      server.add_insecure_port(f'[::1]:{bound}')
    except RuntimeError:  # held by another process, or no IPv6 here
      pass
  return bound


@dataclasses.dataclass
class JobServerConfig:
  job_host: str = 'localhost'
  job_port: int = 8099
  artifact_port: int = 8098
  expansion_port: int = 8097
  artifacts_dir: Optional[str] = None
  spark_master_url: str = 'local[*]'
  # A Spark Connect endpoint: every job runs over it (the Connect engine).
  spark_remote: Optional[str] = None
  spark_conf: dict = dataclasses.field(default_factory=dict)
  # Ended jobs kept; preparations not run yet are bounded apart, and
  # expire after their timeout only.
  max_invocation_history: int = DEFAULT_MAX_INVOCATION_HISTORY
  max_preparations: int = DEFAULT_MAX_PREPARATIONS
  max_preparations_per_client: Optional[int] = None
  preparation_timeout_secs: float = DEFAULT_PREPARATION_TIMEOUT_SECS
  job_store: Optional[str] = None  # default: <artifacts_dir>/jobs.sqlite
  max_staging_buffer_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
  max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES
  # Which Python transforms the expansion service may build by name
  # (beam:transforms:python:fully_qualified_named), e.g. 'apache_beam.*'.
  # None, Beam's default, allows none.
  fully_qualified_name_glob: Optional[str] = None
  # The status page (web/): None or negative for none, 0 for a free port.
  status_port: Optional[int] = None
  # Whether the status page may cancel jobs (Flink's web.cancel.enable).
  status_cancel: bool = True
  # Host names the status page answers to besides its own (web.hosts).
  status_allowed_hosts: list = dataclasses.field(default_factory=list)
  # IMAGE_GLOB=SPEC for Docker environments (planning.environments).
  environment_overrides: list = dataclasses.field(default_factory=list)
  # URL prefixes the server may fetch URL artifacts from
  # (artifacts.urls.UrlPolicy); none by default.
  artifact_url_allowlist: list = dataclasses.field(default_factory=list)
  # Start Spark at start, in the background (its SQL session and the
  # streaming source too), so that the first job does not wait for it.
  spark_warm_up: bool = True
  # The straggler-split threshold of jobs that set none themselves (an SDK
  # other than Python cannot pass the runner's options): None, the runner's.
  split_stragglers_after_secs: Optional[float] = None


def expansion_options():
  """Options of the expansion service: what expanded transforms run in.

  Expanded transforms get the environment these options describe (Beam's
  ExpansionServiceServicer builds it once): the embedded Python environment,
  the one this runner runs, with no SDK to stage ('container', as Beam's
  expansion_service_main sets). A client's own options cannot change it.
  """
  from apache_beam.options.pipeline_options import PipelineOptions
  from apache_beam.portability import python_urns
  return PipelineOptions([
      '--experiments=beam_fn_api',
      '--sdk_location=container',
      f'--environment_type={python_urns.EMBEDDED_PYTHON}',
  ])


class ArtifactsDirInUseError(RuntimeError):
  """Another job server uses this artifacts directory."""


def _lock_artifacts_dir(root: str):
  """An exclusive lock on root for this process's lifetime (POSIX only)."""
  try:
    import fcntl
  except ImportError:  # Windows: no advisory locks here; nothing enforced
    return None
  path = os.path.join(root, 'server.lock')
  handle = open(path, 'a+', encoding='utf-8')
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.seek(0)
    holder = handle.read().strip() or 'unknown'
    handle.close()
    raise ArtifactsDirInUseError(
        f'Another job server (pid {holder}) is using the artifacts directory '
        f'{root}; stop it or give this one another --artifacts-dir.'
    ) from None
  handle.seek(0)
  handle.truncate()
  handle.write(str(os.getpid()))
  handle.flush()
  return handle


def spark_invoke(config: JobServerConfig,
                 status_url: Callable[[], Optional[str]] = lambda: None,
                 recovery: Optional[StreamingRecovery] = None):
  """The executor handed to the job service: our one engine.
  ``status_url()``: the status page's URL, once it serves. ``recovery``
  places streaming jobs' checkpoints where a restarted server finds them."""
  from beam_pyspark.execution import PipelineExecution
  from beam_pyspark.options import RunnerOptions

  def invoke(job_id, pipeline, options, listener):
    runner_options = RunnerOptions.from_job_options(
        options, master=config.spark_master_url, conf=config.spark_conf,
        remote=config.spark_remote)
    if (config.split_stragglers_after_secs is not None and
        'beam:option:split_stragglers_after_secs:v1' not in options):
      runner_options.split_stragglers_after_secs = (
          config.split_stragglers_after_secs)
    if recovery is not None:
      recovery.assign(job_id, pipeline, runner_options)
    return PipelineExecution(pipeline, runner_options, job_id, listener,
                             status_url=status_url)

  return invoke


class JobServer:
  def __init__(self, config: JobServerConfig, invoke=None):
    self.config = config
    root = config.artifacts_dir or os.path.join(
        os.path.expanduser('~'), '.beam-pyspark', 'artifacts')
    os.makedirs(root, exist_ok=True)
    self.artifacts_dir = root
    # Start-up deletes what no retained job references: a second server on
    # the same directory would delete the first's uploads in flight.
    self._lock_file = _lock_artifacts_dir(root)
    try:
      self._build(config, root, invoke)
    except BaseException:
      # A port in use, say: the directory is free again for another try.
      if getattr(self, 'store', None) is not None:
        self.store.close()
      if self._lock_file is not None:
        self._lock_file.close()
      raise

  def _build(self, config: JobServerConfig, root: str, invoke) -> None:
    from beam_pyspark.artifacts.memory import pin_mmap_threshold
    # Without it, staged chunks freed by the writers stay in malloc's arenas:
    # staging 200 MB left the server up to 100 MB bigger for good.
    pin_mmap_threshold()
    from beam_pyspark.artifacts.retrieval import ArtifactRetrievalService
    from beam_pyspark.artifacts.retrieval import open_url
    from beam_pyspark.artifacts.staging import ArtifactStagingService
    self.url_policy = UrlPolicy(config.artifact_url_allowlist)
    self.staging = ArtifactStagingService(
        os.path.join(root, 'staged'),
        max_buffered_bytes=config.max_staging_buffer_bytes,
        max_artifact_bytes=config.max_artifact_bytes,
        manifest_dir=os.path.join(root, 'staged-jobs'),
        url_policy=self.url_policy)
    # URL artifacts are fetched when workers ask, and only the URLs staged
    # jobs depend on, which the URL policy allowed (checked again here: a
    # job staged by an earlier run under another allowlist).
    self.retrieval = ArtifactRetrievalService(
        os.path.join(root, 'staged'),
        url_opener=open_url,
        url_allowed=lambda url: (self.url_policy.allows(url) and
                                 self.staging.stages_url(url)))
    host = config.job_host
    self._artifact_server = grpc_server(16)
    beam_artifact_api_pb2_grpc.add_ArtifactStagingServiceServicer_to_server(
        self.staging, self._artifact_server)
    beam_artifact_api_pb2_grpc.add_ArtifactRetrievalServiceServicer_to_server(
        self.retrieval, self._artifact_server)
    self.artifact_port = bind_port(
        self._artifact_server, host, config.artifact_port, '--artifact-port')

    self.store = JobStore(
        config.job_store or os.path.join(root, 'jobs.sqlite'))
    # Staged files live as long as their job's history entry: keep those of
    # the jobs the store still lists, delete everything else an earlier
    # process left (see ArtifactStagingService.recover).
    self.recovery = self.staging.recover(
        r.staging_token for r in self.store.jobs() if r.staging_token)
    # Streaming jobs' checkpoints, under root so that they outlive this
    # process: the next start resumes the jobs it left unfinished.
    self.checkpoints = StreamingRecovery(root)
    self.service = JobService(
        invoke or spark_invoke(config, lambda: self.status_url,
                               self.checkpoints),
        staging=self.staging,
        staging_endpoint=f'{host}:{self.artifact_port}',
        store=self.store,
        max_invocation_history=config.max_invocation_history,
        spark_master=config.spark_master_url,
        recovery=self.checkpoints,
        environment_overrides=parse_overrides(config.environment_overrides),
        max_preparations=config.max_preparations,
        max_preparations_per_client=config.max_preparations_per_client,
        preparation_timeout_secs=config.preparation_timeout_secs,
        url_policy=self.url_policy)
    self._job_server = grpc_server(64)
    beam_job_api_pb2_grpc.add_JobServiceServicer_to_server(
        self.service, self._job_server)
    self._stopped = threading.Event()
    self._job_server.add_generic_rpc_handlers((health_handler(
        lambda: not self.service.registry.closing, self._stopped),))
    self.job_port = bind_port(self._job_server, host, config.job_port,
                              '--job-port')

    self._expansion_server = None
    self.expansion_port = None
    if config.expansion_port is not None and config.expansion_port >= 0:
      from apache_beam.runners.portability.expansion_service import (
          ExpansionServiceServicer)
      self._expansion_server = grpc_server(4)
      beam_expansion_api_pb2_grpc.add_ExpansionServiceServicer_to_server(
          ExpansionServiceServicer(expansion_options()),
          self._expansion_server)
      self.expansion_port = bind_port(
          self._expansion_server, host, config.expansion_port,
          '--expansion-port')
    self._name_filter = None

  def start(self) -> None:
    self._artifact_server.start()
    self._job_server.start()
    self._start_status_page()
    if self._expansion_server is not None:
      from apache_beam.transforms.fully_qualified_named_transform import (
          FullyQualifiedNamedTransform)
      # Beam keeps the glob on the class: process-wide, as in Beam's own
      # expansion_service_main. Restored by stop().
      self._name_filter = FullyQualifiedNamedTransform.with_filter(
          self.config.fully_qualified_name_glob)
      self._name_filter.__enter__()
      self._expansion_server.start()
    if self.config.spark_warm_up:
      threading.Thread(target=self._warm_up_spark, daemon=True,
                       name='beam-pyspark-warm-up').start()
    # Once serving: clients of the resumed jobs can follow them here.
    for job_id in self.service.resume_interrupted():
      _LOGGER.info('Resuming job %s from its checkpoint', job_id)

  def shutdown(self, grace_secs: float, why: str = 'The job server is stopping'
               ) -> None:
    """Stops taking jobs, stops streaming ones for the next start to
    resume, lets other running ones finish within ``grace_secs``, cancels
    the rest, recording why (then call ``stop``)."""
    self.service.registry.shutdown(grace_secs, why)

  status_url: Optional[str] = None
  _status = None

  def _warm_up_spark(self) -> None:
    """Spark started and warmed up before the first job asks: a streaming
    job's first micro-batch otherwise waits for Spark's JVM and its SQL
    machinery, 10-30 s of a fresh process (benchmarks/streaming_startup.py).
    Failing here costs nothing: the first job starts Spark itself and
    reports why it cannot."""
    from beam_pyspark.engine import warm_up  # pylint: disable=import-outside-toplevel
    started = time.monotonic()
    try:
      warm_up(self.config.spark_master_url, self.config.spark_conf,
              self.config.spark_remote)
    except Exception as exn:  # pylint: disable=broad-except
      _LOGGER.warning('Could not start Spark ahead of the first job (%s); '
                      'the first job starts it.', exn)
      return
    _LOGGER.info('Spark is started and warmed up for jobs (%.1f s)',
                 time.monotonic() - started)

  def _start_status_page(self) -> None:
    """The status page, if asked for; a port in use costs the page, not
    the job server."""
    port = self.config.status_port
    if port is None or port < 0:
      return
    from beam_pyspark.web.server import StatusPages  # pylint: disable=import-outside-toplevel
    from beam_pyspark.web.server import StatusServer  # pylint: disable=import-outside-toplevel
    pages = StatusPages(self.service.registry,
                        cancel_enabled=self.config.status_cancel)
    try:
      self._status = StatusServer(
          pages, self.config.job_host, port,
          allowed_hosts=self.config.status_allowed_hosts).start()
    except OSError as exn:
      _LOGGER.warning('No status page: could not listen on %s:%s (%s)',
                      self.config.job_host, port, exn)
      return
    self.status_url = self._status.url
    _LOGGER.info('Status page: %s', self.status_url)

  def stop(self, grace: Optional[float] = 1.0) -> None:
    self._stopped.set()
    if self._status is not None:
      self._status.stop()
      self._status = None
    for server in (self._job_server, self._artifact_server,
                   self._expansion_server):
      if server is not None:
        server.stop(grace)
    if self._name_filter is not None:
      self._name_filter.__exit__(None, None, None)
      self._name_filter = None
    self.store.close()
    if self._lock_file is not None:
      self._lock_file.close()  # releases the lock
      self._lock_file = None

  def wait(self) -> None:
    self._job_server.wait_for_termination()
