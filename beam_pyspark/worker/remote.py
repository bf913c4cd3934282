"""SDK harnesses in their own processes, driven over the gRPC Fn API.

For a stage whose environment is not the embedded one (PROCESS, EXTERNAL and
so LOOPBACK, Beam's subprocess and embedded-gRPC environments), the Spark
Python worker running the task serves the runner side of the Fn API: control
(bidirectional instruction stream, descriptors fetched on request), data,
state, logging, provisioning and artifact retrieval, through Beam's own
``GrpcServer`` and worker handlers. One harness per (job, environment) is
started by the first task that needs it and kept for the Python worker's
life (a PySpark worker runs one task at a time), reused by later tasks of
the same job; it is shut down when idle for ``IDLE_SECS``, when the cache is
full, or when the Python worker exits.

A harness that dies fails the bundle it was running with a message naming
the environment and, for processes, the exit code.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_fn_api_pb2_grpc
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.portability.api import endpoints_pb2
from apache_beam.runners.portability.fn_api_runner import fn_runner
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.worker import sdk_worker
from google.protobuf import json_format
from google.protobuf import struct_pb2
from google.protobuf import text_format

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import DATA_INPUT_URN
from beam_pyspark.planning.plan import DATA_OUTPUT_URN
from beam_pyspark.planning.validate import concrete_environment
from beam_pyspark.worker.harness import send_input

_LOGGER = logging.getLogger(__name__)

IDLE_SECS = 120.0
_MAX_HARNESSES = 8
# How long a failed task waits for its worker's harnesses to stop.
STOP_ALL_SECS = 10.0
# How long a task waits, at its end, for the harness's log stream to go
# quiet, so that what the bundle logged is attributed to it.
LOG_QUIET_SECS = 0.1
LOG_WAIT_MAX_SECS = 1.0

_lock = threading.Lock()
_harnesses: 'collections.OrderedDict[tuple, RemoteHarness]' = (
    collections.OrderedDict())


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


class _ProcessWorkerHandler(worker_handlers.GrpcWorkerHandler):
  """``beam:env:process:v1``: the configured command, started here.

  The command gets both conventions: the boot flags that Beam's container
  boot programs take (--id, --control_endpoint, ...) and the environment
  variables that ``apache_beam.runners.worker.sdk_worker_main`` reads.
  """
  def __init__(self, payload, state, provision_info, grpc_server):
    super().__init__(state, provision_info, grpc_server)
    self._payload = payload
    self.process: Optional[subprocess.Popen] = None

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
    env.update(self._payload.env)
    env.update(
        CONTROL_API_SERVICE_DESCRIPTOR=text_format.MessageToString(control),
        LOGGING_API_SERVICE_DESCRIPTOR=text_format.MessageToString(logging_ep),
        PIPELINE_OPTIONS=options,
        WORKER_ID=self.worker_id,
        RUNNER_CAPABILITIES=' '.join(worker_handlers.FNAPI_RUNNER_CAPABILITIES))
    flags = [
        f'--id={self.worker_id}',
        f'--provision_endpoint={control.url}',
        f'--control_endpoint={control.url}',
        f'--artifact_endpoint={control.url}',
        f'--logging_endpoint={logging_ep.url}',
    ]
    command = self._payload.command
    with worker_handlers.SUBPROCESS_LOCK:
      self.process = subprocess.Popen(
          # exec: the harness replaces the shell, so its exit status is ours
          'exec ' + command + ' ' + ' '.join(shlex.quote(f) for f in flags),
          shell=True, env=env, start_new_session=True)

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


  def stop_worker(self):
    if self.process is not None and self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(10)
      except subprocess.TimeoutExpired:
        self.process.kill()


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


def _loopback_host(port: int) -> Optional[str]:
  """An address of this host's loopback of its own for one harness's
  servers: 127.x.y.z, reachable on Linux (lo holds 127.0.0.0/8), checked.

  gRPC shares one connection (and its reconnect backoff) between all the
  channels of a process to the same address. A harness whose servers went
  away with their process (a killed Python worker) keeps retrying its open
  streams to their ports; a later harness of the same process (LOOPBACK's
  client runs them all) whose server was given one of those ports would
  share that failing connection: its state stream fails at once, its
  control channel may not get ready. Under an address of their own, a later
  server's ports are new addresses even when the port numbers are not.
  """
  if not sys.platform.startswith('linux'):
    return None
  rand = random.SystemRandom()
  host = '127.%d.%d.%d' % (
      rand.randrange(256), rand.randrange(256), rand.randrange(1, 255))
  try:
    with socket.create_connection((host, port), timeout=1.0):
      return host
  except OSError:
    return None


_LOCAL_HOSTS = ('localhost', '127.0.0.1', '[::1]', '::1')


def _host_from_worker(original):
  def host_from_worker(self):
    host = getattr(self._grpc_server, 'loopback_host', None)  # pylint: disable=protected-access
    if host is not None:
      payload = getattr(self, '_external_payload', None)
      if payload is None or payload.endpoint.url.rsplit(
          ':', 1)[0] in _LOCAL_HOSTS:
        return host  # the harness runs on this host
    return original(self)
  return host_from_worker


# Only servers our _Manager starts carry a loopback_host: Beam's own runners
# in the same process are unaffected.
for _cls in (worker_handlers.GrpcWorkerHandler,
             worker_handlers.ExternalWorkerHandler):
  if 'host_from_worker' in vars(_cls):
    _cls.host_from_worker = _host_from_worker(vars(_cls)['host_from_worker'])


class _Manager(worker_handlers.WorkerHandlerManager):
  """Beam's manager, with our state servicer, logging service and PROCESS."""
  def __init__(self, environments, provision_info, state):
    _unique_worker_ids()
    super().__init__(environments, provision_info)
    self.state_servicer = state
    self.logs = _LogEntryService()

  def start(self, environment_id: str):
    environment = self._environments[environment_id]
    with _patched(worker_handlers, 'BasicLoggingService', lambda: self.logs):
      self._grpc_server = worker_handlers.GrpcServer(
          self.state_servicer, self._job_provision_info, self)
    self._grpc_server.loopback_host = _loopback_host(
        self._grpc_server.control_port)
    if environment.urn == common_urns.environments.PROCESS.urn:
      handler = _ProcessWorkerHandler(
          beam_runner_api_pb2.ProcessPayload.FromString(environment.payload),
          self.state_servicer,
          self._job_provision_info.for_environment(environment),
          self._grpc_server)
      self._cached_handlers[environment_id].append(handler)
      self._workers_by_id[handler.worker_id] = handler
      handler.start_worker()
      return handler
    return self.get_worker_handlers(environment_id, 1)[0]


@contextlib.contextmanager
def _patched(module, name, value):
  with _lock_patch:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
      yield
    finally:
      setattr(module, name, saved)


_lock_patch = threading.Lock()


class RemoteHarness:
  """A harness of one environment of one job, over gRPC."""
  _ids = itertools.count(1)

  def __init__(
      self, job_id: str, environment_id: str,
      components: beam_runner_api_pb2.Components,
      pipeline_options: Optional[dict], state):
    self.job_id = job_id
    self.environment_id = environment_id
    environments = {
        env_id: concrete_environment(env)
        for env_id, env in components.environments.items()
    }
    self.environment = environments[environment_id]
    info = beam_provision_api_pb2.ProvisionInfo(
        pipeline_options=_options_struct(pipeline_options or {}))
    self.state = state
    self.manager = _Manager(
        environments, fn_runner.ExtendedProvisionInfo(info, job_name=job_id),
        state)
    self.handler = self.manager.start(environment_id)
    self.runner_side = self.handler.data_conn
    self._descriptors: dict[str, beam_fn_api_pb2.ProcessBundleDescriptor] = {}
    self.last_split = None
    self.last_used = time.monotonic()

  # -- the harness interface StageRunner uses ---------------------------------

  def descriptor_for(self, stage_name: str, descriptor: bytes):
    d = self._descriptors.get(stage_name)
    if d is None:
      d = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(descriptor)
      data_url = self.handler.data_api_service_descriptor().url
      for transform in d.transforms.values():
        if transform.spec.urn in (DATA_INPUT_URN, DATA_OUTPUT_URN):
          port = beam_fn_api_pb2.RemoteGrpcPort.FromString(
              transform.spec.payload)
          port.api_service_descriptor.url = data_url
          transform.spec.payload = port.SerializeToString()
      d.state_api_service_descriptor.url = (
          self.handler.state_api_service_descriptor().url)
      d.timer_api_service_descriptor.url = data_url
      self.manager.register_process_bundle_descriptor(d)
      self._descriptors[stage_name] = d
    return d

  def next_instruction_id(self) -> str:
    return 'bundle_%d' % next(self._ids)

  def process_bundle(
      self, descriptor, iid: str, data: dict, timers: dict, expected: list,
      split: Optional[tuple] = None):
    """Sends a bundle's input, runs it; returns (response, output elements).

    Output is read while the bundle runs (the data plane's queues are
    bounded); a dead harness aborts the wait with a clear error. With
    ``split`` = (input transform id, seconds), a bundle still running after
    that long is asked for its progress and split at half its remainder;
    the split's response is then in ``self.last_split``.
    """
    self.last_split = None
    monitor = None
    finished = threading.Event()
    if split is not None:
      monitor = threading.Thread(
          target=self._split_straggler, args=(iid, split, finished),
          name=f'split-{iid}', daemon=True)
    conn = self.runner_side
    send_input(conn, iid, data, timers)
    future = self.handler.control_conn.push(
        beam_fn_api_pb2.InstructionRequest(
            instruction_id=iid,
            process_bundle=beam_fn_api_pb2.ProcessBundleRequest(
                process_bundle_descriptor_id=descriptor.id)))
    if monitor is not None:
      monitor.start()
    dead = []

    def abort():
      if future.is_done() and future.get().error:
        return True
      reason = self.dead()
      if reason:
        dead.append(reason)
        return True
      return False

    try:
      outputs = list(conn.input_elements(iid, expected, abort_callback=abort))
    finally:
      finished.set()
      if monitor is not None:
        monitor.join()
    if dead:
      raise PipelineExecutionError(
          f'{dead[0]} while running bundle {iid} of job {self.job_id} '
          f'(environment {self.environment_id!r}, {self.environment.urn}). '
          'Check the harness command and its log above.')
    response = self._wait(future, iid)
    self.last_used = time.monotonic()
    return response, outputs

  def _split_straggler(self, iid: str, split: tuple, finished) -> None:
    """Splits bundle ``iid`` once it has run ``after_secs``; a bundle the
    harness cannot split yet (not started, e.g. on a loaded machine, or at
    an unsplittable point) is asked again every ``after_secs`` until it
    splits or ends."""
    after_secs = split[1]
    started = time.monotonic()
    while not finished.wait(after_secs):
      if self._try_split(iid, split, finished, started):
        return

  def _try_split(self, iid: str, split: tuple, finished, started) -> bool:
    input_id = split[0]
    try:
      progress = self.do(
          beam_fn_api_pb2.InstructionRequest(
              process_bundle_progress=beam_fn_api_pb2.
              ProcessBundleProgressRequest(instruction_id=iid)))
      if finished.is_set() or progress.error:
        return False
      index = _read_index(progress.process_bundle_progress.monitoring_infos,
                          input_id)
      response = self.do(
          beam_fn_api_pb2.InstructionRequest(
              process_bundle_split=beam_fn_api_pb2.ProcessBundleSplitRequest(
                  instruction_id=iid,
                  desired_splits={
                      input_id: beam_fn_api_pb2.ProcessBundleSplitRequest.
                      DesiredSplit(fraction_of_remainder=0.5)
                  })))
      if response.error:
        return False
      result = response.process_bundle_split
      if result.residual_roots or result.channel_splits:
        self.last_split = result
        _LOGGER.info(
            'Split straggling bundle %s after %.1fs at input element %s: %d '
            'residual root(s) and %d channel split(s) go to another task',
            iid, time.monotonic() - started,
            'unknown' if index is None else index,
            len(result.residual_roots), len(result.channel_splits))
        return True
    except Exception:  # pylint: disable=broad-except
      _LOGGER.debug('Could not split bundle %s', iid, exc_info=True)
    return False

  def do(self, request: beam_fn_api_pb2.InstructionRequest):
    if not request.instruction_id:
      request.instruction_id = self.next_instruction_id()
    return self._wait(self.handler.control_conn.push(request),
                      request.instruction_id)

  def flush_logs(self) -> None:
    """Waits briefly for log entries the harness is still sending."""
    deadline = time.monotonic() + LOG_WAIT_MAX_SECS
    while time.monotonic() < deadline:
      last = max(self.manager.logs.last_entry, self.last_used)
      if time.monotonic() - last >= LOG_QUIET_SECS:
        return
      time.sleep(LOG_QUIET_SECS / 4)

  def dead(self) -> Optional[str]:
    handler = self.handler
    if isinstance(handler, _ProcessWorkerHandler):
      return handler.dead()
    thread = getattr(handler, 'worker_thread', None)
    if thread is not None and not thread.is_alive():
      return 'the SDK harness stopped'
    return None

  def _wait(self, future, iid):
    # ControlFuture.get(timeout) cannot tell a timeout apart; wait on its
    # condition and look at the harness between waits.
    while True:
      with future._condition:  # pylint: disable=protected-access
        if not future.is_done() and future._exception is None:  # pylint: disable=protected-access
          future._condition.wait(1.0)  # pylint: disable=protected-access
      if future.is_done() or future._exception is not None:  # pylint: disable=protected-access
        return future.get()
      reason = self.dead()
      if reason:
        raise PipelineExecutionError(
            f'{reason} while running instruction {iid} of job {self.job_id} '
            f'(environment {self.environment_id!r}).')

  def shutdown(self) -> None:
    try:
      self.manager.close_all()
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('Error stopping the SDK harness of %s', self.job_id,
                      exc_info=True)


def _read_index(infos, input_id: str) -> Optional[int]:
  """The element index the harness has reached on ``input_id``."""
  from apache_beam.metrics import monitoring_infos as mi
  urn = common_urns.monitoring_info_specs.DATA_CHANNEL_READ_INDEX.spec.urn
  for info in infos:
    if (info.urn == urn and
        info.labels.get(mi.PTRANSFORM_LABEL) == input_id):
      return mi.extract_counter_value(info)
  return None


def _options_struct(options: dict) -> struct_pb2.Struct:
  struct = struct_pb2.Struct()
  for key, value in options.items():
    if isinstance(value, int) and not isinstance(value, bool):
      value = str(value)  # a Struct holds doubles; the harness wants ints

    try:
      struct.update({key: value})
    except (ValueError, TypeError):
      struct.update({key: json.dumps(value, default=str)})
  return struct


def is_remote(environment: beam_runner_api_pb2.Environment) -> bool:
  return concrete_environment(environment).urn != python_urns.EMBEDDED_PYTHON


def harness_for(
    job_id: str, environment_id: str,
    components: beam_runner_api_pb2.Components,
    pipeline_options: Optional[dict], state) -> RemoteHarness:
  key = (job_id, environment_id)
  stale = []
  with _lock:
    harness = _harnesses.get(key)
    if harness is not None and harness.dead():
      stale.append(_harnesses.pop(key))
      harness = None
    now = time.monotonic()
    for other_key, other in list(_harnesses.items()):
      if other_key != key and now - other.last_used > IDLE_SECS:
        stale.append(_harnesses.pop(other_key))
  for old in stale:
    old.shutdown()
  _ensure_reaper()
  _stop_on_hangup()
  if harness is None:
    harness = RemoteHarness(
        job_id, environment_id, components, pipeline_options, state)
    with _lock:
      _harnesses[key] = harness
      evicted = []
      while len(_harnesses) > _MAX_HARNESSES:
        evicted.append(_harnesses.popitem(last=False)[1])
    for old in evicted:
      old.shutdown()
  with _lock:
    _harnesses.move_to_end(key)
  return harness


def discard_harness(job_id: str, environment_id: str) -> None:
  with _lock:
    harness = _harnesses.pop((job_id, environment_id), None)
  if harness is not None:
    harness.shutdown()


def release_job(job_id: str) -> None:
  with _lock:
    keys = [k for k in _harnesses if k[0] == job_id]
    harnesses = [_harnesses.pop(k) for k in keys]
  for h in harnesses:
    h.shutdown()


def _reap_idle() -> None:
  """Stops harnesses idle for IDLE_SECS (their job has likely ended)."""
  while True:
    time.sleep(max(1.0, IDLE_SECS / 4))
    now = time.monotonic()
    with _lock:
      idle = [k for k, h in _harnesses.items() if now - h.last_used > IDLE_SECS]
      stale = [_harnesses.pop(k) for k in idle]
    for h in stale:
      h.shutdown()


_reaper: Optional[threading.Thread] = None


def _ensure_reaper() -> None:
  global _reaper
  with _lock:
    if _reaper is None:
      _reaper = threading.Thread(
          target=_reap_idle, name='beam-pyspark-harness-reaper', daemon=True)
      _reaper.start()


def stop_all(timeout: float = STOP_ALL_SECS) -> None:
  """Stops every harness of this Python worker, waiting at most ``timeout``.

  For a Python worker about to go: PySpark ends the worker of a failed task
  with ``os._exit`` (no atexit hook), and a stopping Spark ends its workers
  with SIGHUP (``_stop_on_hangup``). Servers that vanish with the process
  leave each harness's open state stream to gRPC's retries (Beam's policy
  for UNAVAILABLE), refused connections whose backoff gRPC's process-wide
  subchannel pool shares with any later channel to the same address: in a
  process of many harnesses (LOOPBACK's client) a later harness whose
  server got the freed port then fails its state stream at once ("failed
  to connect to all addresses"), and Beam keeps that error. A harness
  stopped first ends its streams cleanly.
  """
  with _lock:
    harnesses = list(_harnesses.values())
    _harnesses.clear()
  if not harnesses:
    return

  def stop():
    for h in harnesses:
      h.shutdown()

  # A harness stuck in user code never lets its control stream end: the
  # task's failure must not wait for it.
  stopper = threading.Thread(
      target=stop, name='beam-pyspark-harness-stop', daemon=True)
  stopper.start()
  stopper.join(timeout)


_hangup_for_pid: Optional[int] = None


def _stop_on_hangup() -> None:
  """PySpark's daemon ends its Python workers with SIGHUP when Spark stops
  (their default action: die at once). A worker with harnesses stops them
  first (``stop_all``), then dies of the signal as it would have."""
  global _hangup_for_pid
  if _hangup_for_pid == os.getpid():
    return
  if threading.current_thread() is not threading.main_thread():
    return  # only the main thread may set a handler; tasks run there
  if signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None):
    return  # not PySpark's worker default: someone else's handler
  _hangup_for_pid = os.getpid()

  def on_hangup(signum, _frame):
    stop_all(STOP_ALL_SECS / 2)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)

  signal.signal(signal.SIGHUP, on_hangup)


@atexit.register
def _shutdown_all() -> None:
  with _lock:
    harnesses = list(_harnesses.values())
    _harnesses.clear()
  for h in harnesses:
    h.shutdown()
