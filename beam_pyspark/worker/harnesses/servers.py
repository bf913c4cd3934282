"""The runner's side of the gRPC Fn API for harnesses in their own processes.

Beam's own ``GrpcServer`` and worker handlers serve control (bidirectional
instruction stream, descriptors fetched on request), data, state, logging,
provisioning and artifact retrieval; this module adds what they lack here:
the PROCESS environment started with both boot conventions, worker ids
unique across Spark's forked Python workers, a loopback address of each
harness's own, and the harness's logs into this process's logging.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import grpc

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_fn_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability import artifact_service
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from google.protobuf import json_format
from google.protobuf import text_format

from beam_pyspark.worker.setup import artifacts as job_artifacts

_LOGGER = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECS = 0.5

# What a PROCESS harness's failure quotes of its stderr: its last lines
# (a boot's message, a JVM's exception), each cut to so many characters.
TAIL_LINES = 20
TAIL_LINE_CHARS = 1000
# How long a dead harness's failure waits for the rest of its stderr (a
# child it left may hold the pipe open: the tail then ends where it is).
TAIL_WAIT_SECS = 2.0


class StderrTail:
  """A harness process's stderr: forwarded to this process's (the
  executor's log, where it always went) and its last lines kept, so that
  the harness's failure can say in the job's messages what it said before
  it went (issue 40: a Java boot's reason reached only the job server's
  stderr)."""
  def __init__(self, stream):
    self._stream = stream
    self._lines: collections.deque = collections.deque(maxlen=TAIL_LINES)
    self._lock = threading.Lock()
    self._thread = threading.Thread(
        target=self._pump, name='beam-pyspark-harness-stderr', daemon=True)
    self._thread.start()

  def _pump(self) -> None:
    stream = self._stream
    try:
      while True:
        # Bounded: a line without an end is kept in pieces.
        raw = stream.readline(64 << 10)
        if not raw:
          return
        try:
          os.write(2, raw)
        except OSError:
          pass
        text = raw.decode('utf-8', 'replace').rstrip('\r\n')
        if len(text) > TAIL_LINE_CHARS:
          text = text[:TAIL_LINE_CHARS] + '...'
        with self._lock:
          self._lines.append(text)
    except (OSError, ValueError):
      pass  # closed under us: the harness is being stopped
    finally:
      with contextlib.suppress(OSError, ValueError):
        stream.close()

  def lines(self, wait: float = 0.0) -> list[str]:
    """The last lines so far (after waiting up to ``wait`` seconds for the
    stream's end, when the process has exited)."""
    if wait > 0:
      self._thread.join(wait)
    with self._lock:
      return list(self._lines)

class _LogEntryService(beam_fn_api_pb2_grpc.BeamFnLoggingServicer):
  """The harness's log entries, into this process's logging.

  Each entry is logged at its severity under the harness logger's name, so
  the task's log capture forwards it to the job like any other record.
  """
  def __init__(self):
    self.last_entry = 0.0

  def Logging(self, log_messages, context=None):
    yield beam_fn_api_pb2.LogControl()
    for batch in log_messages:
      for entry in batch.log_entries:
        self.last_entry = time.monotonic()
        level = worker_handlers.LOGENTRY_TO_LOG_LEVEL_MAP.get(
            entry.severity, logging.INFO)
        text = entry.message
        if entry.trace:
          text += '\n' + entry.trace
        logging.getLogger(entry.log_location or 'sdk_harness').log(
            level, '%s', text)


class ProcessWorkerHandler(worker_handlers.GrpcWorkerHandler):
  """``beam:env:process:v1``: the configured command, started here.

  The command gets both conventions: the boot flags that Beam's container
  boot programs take (--id, --control_endpoint, ...) and the environment
  variables that ``apache_beam.runners.worker.sdk_worker_main`` reads.
  """
  def __init__(self, payload, state, provision_info, grpc_server):
    super().__init__(state, provision_info, grpc_server)
    self._payload = payload
    self.process: Optional[subprocess.Popen] = None
    self.semi_persist_dir: Optional[str] = None
    self.stderr: Optional[StderrTail] = None

  def start_worker(self):
    control = self.control_api_service_descriptor()
    logging_ep = self.logging_api_service_descriptor()
    options = json_format.MessageToJson(
        self.provision_info.provision_info.pipeline_options)
    env = dict(os.environ)
    # What this Python worker imports (the job's staged dependencies among
    # it), the harness imports too.
    env['PYTHONPATH'] = os.pathsep.join(
        [p for p in sys.path if p] +
        [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
    # "python" in a command is this worker's own interpreter, the one with
    # the runner (python -m beam_pyspark.boot ...).
    env['PATH'] = os.pathsep.join(
        [os.path.dirname(sys.executable), env.get('PATH', '')])
    env.update(self._payload.env)
    env.update(
        CONTROL_API_SERVICE_DESCRIPTOR=text_format.MessageToString(control),
        LOGGING_API_SERVICE_DESCRIPTOR=text_format.MessageToString(logging_ep),
        PIPELINE_OPTIONS=options,
        WORKER_ID=self.worker_id,
        RUNNER_CAPABILITIES=' '.join(worker_handlers.FNAPI_RUNNER_CAPABILITIES))
    # The harness's own files (a boot's retrieved artifacts, say): removed
    # when the harness stops, since a boot that execs its harness cannot.
    self.semi_persist_dir = tempfile.mkdtemp(prefix='beam-pyspark-harness-')
    flags = [
        f'--id={self.worker_id}',
        f'--provision_endpoint={control.url}',
        f'--control_endpoint={control.url}',
        f'--artifact_endpoint={control.url}',
        f'--logging_endpoint={logging_ep.url}',
        f'--semi_persist_dir={self.semi_persist_dir}',
    ]
    command = self._payload.command
    with worker_handlers.SUBPROCESS_LOCK:
      self.process = subprocess.Popen(
          # exec: the harness replaces the shell, so its exit status is ours
          'exec ' + command + ' ' + ' '.join(shlex.quote(f) for f in flags),
          shell=True, env=env, start_new_session=True,
          stderr=subprocess.PIPE)
    self.stderr = StderrTail(self.process.stderr)

  def dead(self) -> Optional[str]:
    if self.process is None or self.process.poll() is None:
      return None
    rc = self.process.returncode
    if rc < 0:
      try:
        how = f'was killed by signal {-rc} ({signal.Signals(-rc).name})'
      except ValueError:
        how = f'was killed by signal {-rc}'
    else:
      how = f'exited with code {rc}'
    return f'the SDK harness process ({self._payload.command!r}) {how}'

  def last_lines(self, wait: float = 0.0) -> list[str]:
    """The last lines the harness process wrote to its stderr."""
    return self.stderr.lines(wait) if self.stderr is not None else []


  def stop_worker(self):
    if self.process is not None and self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(10)
      except subprocess.TimeoutExpired:
        self.process.kill()
    if self.semi_persist_dir is not None:
      shutil.rmtree(self.semi_persist_dir, ignore_errors=True)


# How long a harness's end waits for its worker pool to stop the worker.
STOP_WORKER_SECS = 5.0


class ExternalWorkerHandler(worker_handlers.ExternalWorkerHandler):
  """``beam:env:external:v1`` (and so LOOPBACK): Beam's handler, which asks
  the worker pool to start a worker, and here at the harness's end also to
  stop it (``StopWorker``; Beam's does nothing).

  Beam's ``GrpcServer.close`` gives the harness's open streams 5 s to end.
  A Go harness keeps its data, state and logging streams open until its
  pool stops it, so each harness's end waited those 5 s: 10 of a small Go
  job's 13 s on local[2]. Stopped first, it ends them at once.
  """
  def stop_worker(self):
    url = self._external_payload.endpoint.url
    try:
      with grpc.insecure_channel(url) as channel:
        response = beam_fn_api_pb2_grpc.BeamFnExternalWorkerPoolStub(
            channel).StopWorker(
                beam_fn_api_pb2.StopWorkerRequest(worker_id=self.worker_id),
                timeout=STOP_WORKER_SECS)
    except grpc.RpcError as exn:
      _LOGGER.debug('The worker pool at %s did not stop worker %s: %s', url,
                    self.worker_id, exn)
      return
    if response.error:
      _LOGGER.debug('The worker pool at %s did not stop worker %s: %s', url,
                    self.worker_id, response.error)


_ids_for_pid: Optional[int] = None


def _unique_worker_ids() -> None:
  """Worker ids unique across processes, not only within one.

  Beam numbers worker handlers from 0 per process, so every Spark Python
  worker (forked alike) would ask a shared worker pool (LOOPBACK, EXTERNAL)
  for "worker_0". Servers of ended jobs free their ports for new ones; a
  harness of an ended job reconnecting to a new server on a reused port
  must not pass for that server's own harness.
  """
  global _ids_for_pid
  with worker_handlers.WorkerHandler._lock:  # pylint: disable=protected-access
    if _ids_for_pid != os.getpid():
      _ids_for_pid = os.getpid()
      worker_handlers.WorkerHandler._worker_id_counter = (  # pylint: disable=protected-access
          random.SystemRandom().randrange(1 << 40) * 1000)


def _loopback_host() -> str:
  """An address of this host's loopback of its own for one harness's
  servers: 127.x.y.z on Linux (lo holds all of 127.0.0.0/8), else
  127.0.0.1.

  The servers bind there only, never to every interface: the Fn API has no
  authentication, and whoever reaches it runs code as the job (Beam's Java
  runner binds its own to the loopback address too). And gRPC shares one
  connection (and its reconnect backoff) between all the channels of a
  process to the same address: a harness whose servers went away with their
  process (a killed Python worker) keeps retrying its open streams to their
  ports; a later harness of the same process (LOOPBACK's client runs them
  all) whose server was given one of those ports would share that failing
  connection. Under an address of their own, a later server's ports are new
  addresses even when the port numbers are not.
  """
  if not sys.platform.startswith('linux'):
    return '127.0.0.1'
  rand = random.SystemRandom()
  return '127.%d.%d.%d' % (
      rand.randrange(256), rand.randrange(256), rand.randrange(1, 255))


_LOCAL_HOSTS = ('localhost', '127.0.0.1', '[::1]', '::1')


def _bind_host(environment) -> str:
  """Where a harness's Fn API servers listen: a loopback address when the
  harness runs on this host (PROCESS, Beam's subprocess and embedded-gRPC
  environments, an EXTERNAL worker pool on this host such as LOOPBACK's on
  a local master), else this host's address on the route to the worker
  pool, never every interface."""
  if environment.urn != common_urns.environments.EXTERNAL.urn:
    return _loopback_host()
  payload = beam_runner_api_pb2.ExternalPayload.FromString(environment.payload)
  host = payload.endpoint.url.rsplit(':', 1)[0].strip('[]')
  if host in _LOCAL_HOSTS or host.startswith('127.'):
    return _loopback_host()
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
      probe.connect((host, 9))  # no packet is sent: this picks the route
      return probe.getsockname()[0]
  except OSError:
    # Not resolvable from here (IPv6 only?): Beam's default, every
    # interface, rather than a harness that cannot connect.
    _LOGGER.warning('Could not find the route to the worker pool at %s; '
                    'its Fn API servers listen on every interface', host)
    return '[::]'


class _BoundServer:
  """A grpc.Server whose ports are opened on one host, not every interface
  (Beam's GrpcServer asks for '[::]:0')."""
  def __init__(self, server, host: str):
    self._server = server
    self._host = host

  def add_insecure_port(self, address: str) -> int:
    if address.startswith('[::]:'):
      address = f'{self._host}:{address[5:]}'
    return self._server.add_insecure_port(address)

  def __getattr__(self, name):
    return getattr(self._server, name)


class _BindingGrpc:
  """The grpc module as Beam's GrpcServer sees it while we build one."""
  def __init__(self, real, host: str):
    self._real = real
    self._host = host

  def server(self, *args, **kwargs):
    return _BoundServer(self._real.server(*args, **kwargs), self._host)

  def __getattr__(self, name):
    return getattr(self._real, name)


def _host_from_worker(original):
  def host_from_worker(self):
    host = getattr(self._grpc_server, 'advertised_host', None)  # pylint: disable=protected-access
    if host is not None and host != '[::]':
      return host  # where its servers listen, and only there
    return original(self)
  return host_from_worker


# Only servers our Manager starts carry an advertised_host: Beam's own runners
# in the same process are unaffected.
for _cls in (worker_handlers.GrpcWorkerHandler,
             worker_handlers.ExternalWorkerHandler):
  if 'host_from_worker' in vars(_cls):
    _cls.host_from_worker = _host_from_worker(vars(_cls)['host_from_worker'])


class Manager(worker_handlers.WorkerHandlerManager):
  """Beam's manager, with our state servicer, logging service and PROCESS."""
  def __init__(self, environments, provision_info, state):
    _unique_worker_ids()
    super().__init__(environments, provision_info)
    self.state_servicer = state
    self.logs = _LogEntryService()

  def start(self, environment_id: str):
    environment = self._environments[environment_id]
    host = _bind_host(environment)
    with _patched(worker_handlers, 'BasicLoggingService', lambda: self.logs), \
        _patched(worker_handlers, 'grpc', _BindingGrpc(grpc, host)), \
        _patched(worker_handlers, 'artifact_service',
                 _JobArtifacts(self._job_provision_info.job_name)):
      self._grpc_server = worker_handlers.GrpcServer(
          self.state_servicer, self._job_provision_info, self)
    self._grpc_server.advertised_host = host
    # When the harness goes, its servers stop with this much grace for
    # the streams still open (Beam's 5 s): a harness that does not end its
    # data, state and logging streams once its control stream is closed
    # (Java's LOOPBACK harness) held every job's release for 5 s a task.
    self._grpc_server._DEFAULT_SHUTDOWN_TIMEOUT_SECS = SHUTDOWN_GRACE_SECS  # pylint: disable=protected-access
    # Beam's own address for the control service says 'localhost'.
    self._grpc_server.control_address = (
        f'{host}:{self._grpc_server.control_port}')
    handler_class, payload_class = _HANDLERS.get(
        environment.urn, (None, None))
    if handler_class is not None:
      handler = handler_class(
          payload_class.FromString(environment.payload),
          self.state_servicer,
          self._job_provision_info.for_environment(environment),
          self._grpc_server)
      self._cached_handlers[environment_id].append(handler)
      self._workers_by_id[handler.worker_id] = handler
      handler.start_worker()
      return handler
    return self.get_worker_handlers(environment_id, 1)[0]


  def close_all(self):
    """Beam's, without waiting out the servers' shutdown grace: the
    harnesses were told to stop (their control streams closed, a process
    terminated), and what a LOOPBACK Java harness keeps open after that
    (data, state, logging) is cut once the grace is over, in the
    background. Waited for, it held each release task (a Spark task per
    slot) for SHUTDOWN_GRACE_SECS, and the next jobs' tasks behind it."""
    server, self._grpc_server = self._grpc_server, None
    super().close_all()
    if server is not None:
      server.control_handler.done()
      for grpc_server in (server.control_server, server.data_server,
                          server.state_server, server.logging_server):
        grpc_server.stop(SHUTDOWN_GRACE_SECS)


class _JobArtifacts:
  """Beam's artifact_service module as its GrpcServer sees it while we
  build one (issue 26): the Fn API's artifact retrieval that a PROCESS
  harness's boot calls reads the job's artifacts from the driver's
  artifact server (worker.setup.artifacts), not from this host's disk,
  where the job server's paths exist only if the executor shares its
  disk. Paths the driver does not serve, and URLs, go to Beam's reader.
  ``job_id``: RemoteHarness names the provision info's job so."""
  def __init__(self, job_id: str):
    self._job_id = job_id

  def ArtifactRetrievalService(self, file_reader, chunk_size=None):  # pylint: disable=invalid-name
    return artifact_service.ArtifactRetrievalService(
        job_artifacts.reader(self._job_id, file_reader), chunk_size)


# The environments whose handlers are ours, not Beam's.
_HANDLERS = {
    common_urns.environments.PROCESS.urn:
        (ProcessWorkerHandler, beam_runner_api_pb2.ProcessPayload),
    common_urns.environments.EXTERNAL.urn:
        (ExternalWorkerHandler, beam_runner_api_pb2.ExternalPayload),
}


@contextlib.contextmanager
def _patched(module, name, value):
  with _lock_patch:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
      yield
    finally:
      setattr(module, name, saved)


_lock_patch = threading.RLock()  # nested patches in one thread
