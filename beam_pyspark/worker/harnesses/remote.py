"""SDK harnesses in their own processes, driven over the gRPC Fn API.

For a stage whose environment is not the embedded one (PROCESS, EXTERNAL and
so LOOPBACK, Beam's subprocess and embedded-gRPC environments), the Spark
Python worker running the task serves the runner side of the Fn API
(``servers``). The harness cache (``worker.harnesses``) keeps one per (job,
environment), started by the first task that needs it and reused by later
tasks of the same job (a PySpark worker runs one task at a time).

A harness that dies fails the bundle it was running with a message naming
the environment and, for processes, the exit code.
"""

from __future__ import annotations

import itertools
import os
import json
import logging
import threading
import time
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import fn_runner
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from google.protobuf import struct_pb2

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import DATA_INPUT_URN
from beam_pyspark.planning.plan import DATA_OUTPUT_URN
from beam_pyspark.planning.validate import concrete_environment
from beam_pyspark.worker.elements import split_elements
from beam_pyspark.worker.harnesses.base import CollectedBundle
from beam_pyspark.worker.harnesses.base import HarnessLostError
from beam_pyspark.worker.harnesses.base import user_state_tokens
from beam_pyspark.worker.harnesses.base import DelegatingStateHandler
from beam_pyspark.worker.harnesses.base import name_channel_splits
from beam_pyspark.worker.harnesses.base import send_input
from beam_pyspark.worker.harnesses.servers import Manager
from beam_pyspark.worker.harnesses.servers import ProcessWorkerHandler
from beam_pyspark.worker.harnesses.servers import TAIL_WAIT_SECS

_LOGGER = logging.getLogger(__name__)

# How long a task waits, at its end, for the harness's log stream to go
# quiet, so that what the bundle logged is attributed to it.
LOG_QUIET_SECS = 0.1
LOG_WAIT_MAX_SECS = 1.0
# How long a harness may take to open its control stream once started (a
# JVM loading a pipeline's classpath on a loaded machine takes tens of
# seconds). The variable is for tests, which cannot wait that long.
# How long a bundle whose data stream closed waits for the harness process
# to be seen gone, so that its failure says how it went.
PROCESS_EXIT_SECS = 1.0
# A harness that answers none of the runner's requests for so long while
# a bundle waits on it is given up as hung (probed every PROBE_SECS). The
# variable is for tests.
UNRESPONSIVE_SECS = float(
    os.environ.get('BEAM_PYSPARK_HARNESS_UNRESPONSIVE_SECS', '600'))
PROBE_SECS = min(30.0, UNRESPONSIVE_SECS / 3)
CONNECT_TIMEOUT_SECS = float(
    os.environ.get('BEAM_PYSPARK_HARNESS_CONNECT_SECS', '180'))

# Beam's Java worker pool (ExternalWorkerService: LOOPBACK's, and a Java SDK
# container's --worker_pool) starts every harness with the same options,
# and FnHarness shuts down the executor they share as any one of them ends:
# the pool then starts none (tests/test_sdk_java.py).
JAVA_POOL_HINT = (
    'A Java worker pool (LOOPBACK\'s, or a Java SDK container\'s '
    '--worker_pool) starts no harness once one it started has ended, logging '
    '"Failed to start worker ... RejectedExecutionException": start a new '
    'pool (a new pipeline run, for LOOPBACK), or use the PROCESS environment')


class RemoteHarness:
  """A harness of one environment of one job, over gRPC."""
  _ids = itertools.count(1)
  # A bundle's output is collected before process_bundle returns, so a
  # bundle whose channel failed can be run again; its bundles can be split.
  collects_output = True
  splits_bundles = True

  @classmethod
  def for_stage(cls, job_id: str, stage, components, job_options
                ) -> 'RemoteHarness':
    """The harness kind's factory (``worker.harnesses.KINDS``)."""
    return cls(job_id, stage.environment_id, components, job_options,
               DelegatingStateHandler())

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
    self.manager = Manager(
        environments, fn_runner.ExtendedProvisionInfo(info, job_name=job_id),
        state)
    self.started = time.monotonic()
    self.never_connected = False
    # The harness's liveness while a bundle waits on it (_unresponsive).
    self._probe = None  # (ControlFuture, sent at) of the probe in flight
    self._probed = time.monotonic()
    self._hung: Optional[str] = None
    self.handler = self.manager.start(environment_id)
    self.runner_side = self.handler.data_conn
    self._descriptors: dict[str, beam_fn_api_pb2.ProcessBundleDescriptor] = {}
    self.last_split = None
    self.last_used = time.monotonic()
    self._bundle: Optional[str] = None  # the bundle waiting on the harness

  # -- the Harness interface (worker.harnesses.base) --------------------------

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
      split: Optional[tuple] = None, cache_token: Optional[bytes] = None,
      watch=None):
    """Sends a bundle's input, runs it; returns its collected output.

    Output is read while the bundle runs (the data plane's queues are
    bounded); a dead harness aborts the wait with a clear error. With
    ``split`` = (input transform id, seconds), a bundle still running after
    that long is asked for its progress and split at half its remainder;
    the split's response is then in ``self.last_split``. ``watch(iid)`` is
    called once the bundle is sent (a streaming read's checkpointer,
    worker.endpoints, stopped by its caller).
    """
    self.last_split = None
    monitor = None
    finished = threading.Event()
    if split is not None:
      monitor = threading.Thread(
          target=self._split_straggler, args=(iid, split, finished, data),
          name=f'split-{iid}', daemon=True)
    conn = self.runner_side
    self._bundle, self._probed = iid, time.monotonic()
    send_input(conn, iid, data, timers)
    future = self.handler.control_conn.push(
        beam_fn_api_pb2.InstructionRequest(
            instruction_id=iid,
            process_bundle=beam_fn_api_pb2.ProcessBundleRequest(
                process_bundle_descriptor_id=descriptor.id,
                cache_tokens=user_state_tokens(cache_token))))
    if monitor is not None:
      monitor.start()
    if watch is not None:
      watch(iid)
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
    except RuntimeError as exn:
      self._bundle = self._probe = None
      if 'Channel closed prematurely' not in str(exn):
        raise
      # The harness's data stream ended under the bundle. If the harness
      # failed the bundle first (a Kafka read that gave up), that error is
      # the cause, not a lost harness (whose retries hid it).
      failed = _failed_response(future)
      if failed is not None:
        return CollectedBundle(iid, failed, [])
      # Else it went away: its process's end says how (a signal, a code).
      reason = self._dead_within(PROCESS_EXIT_SECS)
      if reason:
        raise self._lost(reason, f'bundle {iid}') from exn
      raise HarnessLostError(
          f'the SDK harness closed its data stream while running bundle '
          f'{iid} of job {self.job_id} (environment {self.environment_id!r}'
          f', {self.environment.urn}): {exn}') from exn
    finally:
      finished.set()
      if monitor is not None:
        monitor.join()
      if dead:
        self._bundle = self._probe = None
    if dead:
      raise self._lost(dead[0], f'bundle {iid}')
    try:
      response = self._wait(future, iid)
    finally:
      self._bundle = self._probe = None
    self.last_used = time.monotonic()
    return CollectedBundle(iid, response, outputs)

  def _split_straggler(self, iid: str, split: tuple, finished, data) -> None:
    """Splits bundle ``iid`` once it has run ``after_secs``; a bundle the
    harness cannot split yet (not started, e.g. on a loaded machine, or at
    an unsplittable point) is asked again every ``after_secs`` until it
    splits or ends."""
    after_secs = split[1]
    started = time.monotonic()
    while not finished.wait(after_secs):
      if self._try_split(iid, split, finished, started, data):
        return

  def _try_split(self, iid: str, split: tuple, finished, started,
                 data) -> bool:
    """Asks for half the bundle's remainder, telling the SDK how many
    elements the bundle reads (Go's SDK, told none, splits past the last
    element: nothing moves)."""
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
                      DesiredSplit(fraction_of_remainder=0.5,
                                   estimated_input_elements=sum(
                                       1 for _ in split_elements(
                                           split[2], data.get(input_id, ()))))
                  })))
      if response.error:
        return False
      result = name_channel_splits(response.process_bundle_split, input_id)
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

  def in_use(self) -> bool:
    return self.state.target is not None

  def reusable_after_error(self) -> bool:
    # A user error leaves it usable, as Beam's harness reports it.
    return self.dead() is None

  def dead(self) -> Optional[str]:
    handler = self.handler
    if isinstance(handler, ProcessWorkerHandler):
      reason = handler.dead()
      if reason:
        return reason
    thread = getattr(handler, 'worker_thread', None)
    if thread is not None and not thread.is_alive():
      return 'the SDK harness stopped'
    return (_control_stream_ended(handler) or self._never_connected() or
            self._unresponsive())

  def _unresponsive(self) -> Optional[str]:
    """Why the harness is given up as hung, if it has answered none of
    the runner's requests for UNRESPONSIVE_SECS although connected: while
    a bundle waits on it, a progress request goes every PROBE_SECS, and
    Beam's harnesses (Python, Java, Go, TypeScript) answer those while
    their bundle's code runs, with progress or an error. One that answers
    nothing is deadlocked, or out of memory, or not a harness at all, and
    its bundle would otherwise wait for ever: no bound but this one applies
    to a harness that connected (the job stayed RUNNING for minutes, no
    message, issue 39)."""
    if self._hung is not None:
      return self._hung
    conn = getattr(self.handler, 'control_conn', None)
    reader = getattr(conn, '_read_thread', None)
    if reader is None or reader.ident is None or self._bundle is None:
      return None  # not connected (_never_connected's), or nothing runs
    now = time.monotonic()
    if self._probe is not None:
      future, sent = self._probe
      if future.is_done() or future._exception is not None:  # pylint: disable=protected-access
        self._probe = None
      elif now - sent >= UNRESPONSIVE_SECS:
        self._hung = (
            f'the SDK harness answered no request of the runner in '
            f'{now - sent:.0f}s (it is connected, but hung: deadlocked, out '
            'of memory, or not an SDK harness)')
        return self._hung
      return None
    if now - self._probed >= PROBE_SECS:
      self._probed = now
      try:
        self._probe = (conn.push(beam_fn_api_pb2.InstructionRequest(
            instruction_id=self.next_instruction_id(),
            process_bundle_progress=beam_fn_api_pb2.
            ProcessBundleProgressRequest(instruction_id=self._bundle))), now)
      except Exception:  # pylint: disable=broad-except
        _LOGGER.debug('Could not probe the harness', exc_info=True)
    return None

  def _never_connected(self) -> Optional[str]:
    """Why the harness is given up for never connecting, if it has not
    opened its control stream CONNECT_TIMEOUT_SECS after it was started
    (a worker pool whose command fails at once, as Beam's Python pool's
    does when its ``python`` lacks Beam, reports nothing)."""
    conn = getattr(self.handler, 'control_conn', None)
    reader = getattr(conn, '_read_thread', None)
    if reader is None or reader.ident is not None:
      return None
    waited = time.monotonic() - self.started
    if waited < CONNECT_TIMEOUT_SECS:
      return None
    self.never_connected = True
    why = (f'the SDK harness never connected to the runner in {waited:.0f}s '
           '(check its command or worker pool, and its log)')
    if self.environment.urn == common_urns.environments.EXTERNAL.urn:
      why += f'. {JAVA_POOL_HINT}'
    return why

  def _lost(self, reason: str, what: str) -> PipelineExecutionError:
    """The error of a harness gone (``reason``: ``dead``'s) while it ran
    ``what``. Its first line ends with the harness's own last words (a
    boot's message, an exception), its last lines of stderr follow: they
    reach the job's messages with it, where the executor's stderr (a job
    server's, a cluster's executor logs) is not at hand."""
    lines = self.last_lines()
    text = (f'{reason} while running {what} of job {self.job_id} '
            f'(environment {self.environment_id!r}, {self.environment.urn})')
    words = last_words(lines)
    if words:
      text += f': {words}'
    if lines:
      text += ('\nIts last lines on stderr:\n' +
               '\n'.join(f'  {line}' for line in lines))
    else:
      text += '. Check the harness command and its log.'
    return self._lost_error()(text)

  def _dead_within(self, secs: float) -> Optional[str]:
    """``dead()``, looked at again for up to ``secs`` (a process whose
    streams just closed is reaped a moment later)."""
    deadline = time.monotonic() + secs
    while True:
      reason = self.dead()
      if reason or time.monotonic() >= deadline:
        return reason
      time.sleep(0.05)

  def last_lines(self) -> list[str]:
    """What a PROCESS harness last wrote to its stderr (none for others:
    an EXTERNAL harness's output is its worker pool's)."""
    handler = self.handler
    if not isinstance(handler, ProcessWorkerHandler):
      return []
    exited = handler.process is not None and handler.process.poll() is not None
    return handler.last_lines(TAIL_WAIT_SECS if exited else 0.0)

  def _lost_error(self) -> type:
    """How a harness that went away fails its bundle: HarnessLostError
    (run once more on a new harness) unless it never connected when its
    runner started its process (a bad command fails a second try too). A
    worker pool's harness (EXTERNAL, LOOPBACK) that never connected is
    asked for again once, should the pool have lost the request (a Java
    pool that starts no more harnesses, JAVA_POOL_HINT, fails the second
    request too: the "1 in 263" Java ValidatesRunner tests that once failed
    so were, as far as their logs tell, that)."""
    if self.never_connected and (
        self.environment.urn != common_urns.environments.EXTERNAL.urn):
      return PipelineExecutionError
    return HarnessLostError

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
        raise self._lost(reason, f'instruction {iid}')

  def shutdown(self) -> None:
    try:
      self.manager.close_all()
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('Error stopping the SDK harness of %s', self.job_id,
                      exc_info=True)


def _control_stream_ended(handler) -> Optional[str]:
  """Why the harness is gone, if its control stream ended without our
  asking: it stopped, or lost its connection to this worker's Fn API
  servers. For an EXTERNAL harness (LOOPBACK's among them) there is no
  process to watch, and a bundle would otherwise wait for ever for output
  that cannot come."""
  conn = getattr(handler, 'control_conn', None)
  reader = getattr(conn, '_read_thread', None)
  if (reader is not None and reader.ident is not None and
      not reader.is_alive() and getattr(conn, '_state', None) ==
      worker_handlers.BeamFnControlServicer.STARTED_STATE):
    return ('the SDK harness closed its control stream (it stopped, or '
            'lost its connection to the runner)')
  return None


def last_words(lines: list[str]) -> str:
  """The line of a harness's last output that says why it went: the last
  one not indented (a stack trace's frames are), else the last one."""
  shown = [line.strip() for line in lines if line.strip()]
  said = [line.strip() for line in lines
          if line.strip() and not line[:1].isspace()]
  return (said or shown or [''])[-1]


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


def _failed_response(future, wait_secs: float = 2.0):
  """The bundle's response if the harness answered it with an error (it
  may come just after its data stream closed), else None."""
  deadline = time.monotonic() + wait_secs
  while not future.is_done() and time.monotonic() < deadline:
    time.sleep(0.05)
  if future.is_done() and future.get().error:
    return future.get()
  return None
