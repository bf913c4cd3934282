"""The in-process Beam Python SDK harness (``beam:env:embedded_python:v1``).

This is the harness that Beam's EmbeddedWorkerHandler drives: an SdkWorker
over a BundleProcessorCache, talking through an in-memory data channel.
Creating one costs descriptor parsing and DoFn setup, so the harness cache
(``worker.harnesses``) keeps one per (job, stage) for the Python worker's
life and every task of that stage reuses it.

A bundle runs in a thread of its own.  Its output (data and timers, in the
chunks the SDK flushes, about 10 MB each) reaches the task's thread through
a queue of a few chunks, so a bundle that fans its input out into more than
the worker can hold streams instead of failing; a full queue holds the
bundle back.  A bundle whose reader stops early is aborted, and its harness
is not reused.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from typing import Iterator
from typing import Optional

from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.worker import data_plane
from apache_beam.runners.worker import sdk_worker
from apache_beam.runners.worker import statecache

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.worker import endpoints
from beam_pyspark.worker.harnesses.base import DelegatingStateHandler
from beam_pyspark.worker.harnesses.base import OutputElement
from beam_pyspark.worker.harnesses.base import send_input
from beam_pyspark.worker.harnesses.base import user_state_tokens
# Registers the transform that reads a bounded source's split (planning.reads)
# with the SDK harness: every in-process harness may be given such a stage.
from beam_pyspark.worker import reads as _split_reader  # pylint: disable=unused-import

# Output chunks a bundle may have written that the task has not read yet.
QUEUE_CHUNKS = 4
# How often a bundle blocked on a full queue checks whether it was aborted.
_PUT_POLL_SECS = 0.1
# How often a reader waiting for output checks that the bundle's thread lives.
_GET_POLL_SECS = 1.0
# How long an aborted bundle's reader waits for its thread to end.
ABORT_JOIN_SECS = 5.0
BUNDLE_THREAD_PREFIX = 'beam-pyspark-bundle-'


class BundleAborted(Exception):
  """The reader of a bundle's output stopped before the bundle ended."""


class _End:
  """The last item of a bundle's output queue."""
  __slots__ = ('response', 'error')

  def __init__(self, response, error):
    self.response = response
    self.error = error


class _OutputQueue:
  """A bundle's output on its way from the harness thread to the task."""
  __slots__ = ('items', 'aborted')

  def __init__(self):
    self.items: queue.Queue = queue.Queue(QUEUE_CHUNKS)
    self.aborted = False

  def put(self, item) -> None:
    """Blocks while the queue is full; raises once the reader is gone."""
    while True:
      if self.aborted:
        raise BundleAborted('the reader of this bundle\'s output stopped')
      try:
        self.items.put(item, timeout=_PUT_POLL_SECS)
        return
      except queue.Full:
        pass

  def abort(self) -> None:
    self.aborted = True
    # Free what was written but will not be read.
    with contextlib.suppress(queue.Empty):
      while True:
        self.items.get_nowait()


class _HarnessChannel(data_plane.InMemoryDataChannel):
  """The SDK's side of the in-memory data channel.

  Input is written to it (by ``inverse()``) before a bundle starts; the
  bundle's output goes to the bundle's queue as the SDK flushes it.
  """
  def __init__(self):
    super().__init__()
    self.queues: dict[str, _OutputQueue] = {}

  def input_elements(self, instruction_id, expected_inputs, abort_callback=None):
    out = self.queues.get(instruction_id)
    for element in super().input_elements(
        instruction_id, expected_inputs, abort_callback):
      if out is not None and out.aborted:
        raise BundleAborted('the reader of this bundle\'s output stopped')
      yield element

  def output_stream(self, instruction_id, transform_id):
    out = self.queues.get(instruction_id)
    if out is None:
      return super().output_stream(instruction_id, transform_id)

    def write(data: bytes) -> None:
      if data:
        out.put(
            beam_fn_api_pb2.Elements.Data(
                instruction_id=instruction_id, transform_id=transform_id,
                data=data))

    return data_plane.ClosableOutputStream.create(write, write, 0)

  def output_timer_stream(self, instruction_id, transform_id, timer_family_id):
    out = self.queues.get(instruction_id)
    if out is None:
      return super().output_timer_stream(
          instruction_id, transform_id, timer_family_id)

    def write(timers: bytes) -> None:
      if timers:
        out.put(
            beam_fn_api_pb2.Elements.Timers(
                instruction_id=instruction_id, transform_id=transform_id,
                timer_family_id=timer_family_id, timers=timers))

    return data_plane.ClosableOutputStream.create(write, write, 0)


class StreamedBundle:
  """The BundleOutput of a bundle running in a harness thread."""
  def __init__(self, harness: 'EmbeddedHarness', instruction_id: str,
               out: _OutputQueue, thread: threading.Thread,
               budget: Optional[endpoints.ClaimBudget] = None):
    self.instruction_id = instruction_id
    self.response = None
    self._budget = budget
    # Set (by another thread) to end a bundle stuck in user code.
    self._failure: Optional[str] = None
    self._harness = harness
    self._out = out
    self._thread = thread
    self._open = True

  def __iter__(self) -> Iterator[OutputElement]:
    items = self._out.items
    end = None
    try:
      while True:
        try:
          item = items.get(timeout=_GET_POLL_SECS)
        except queue.Empty:
          if self._failure is not None:
            raise PipelineExecutionError(self._failure)
          if self._thread.is_alive() or not items.empty():
            continue
          raise RuntimeError(
              f'bundle {self.instruction_id} ended without a response')
        if type(item) is _End:  # pylint: disable=unidiomatic-typecheck
          end = item
          break
        yield item
    finally:
      if end is None:
        self.close()
    self._end(end)

  def fail(self, reason: str) -> None:
    """Gives up on a bundle stuck in user code: its reader raises
    ``reason`` at its next wait (the harness is then dropped)."""
    self._failure = reason

  @property
  def claim_budget(self) -> Optional[endpoints.ClaimBudget]:
    return self._budget

  @property
  def claims_exhausted(self) -> bool:
    """Its claim budget ran out (the bundle checkpointed itself for it)."""
    return self._budget is not None and self._budget.exhausted

  def _end(self, end: _End) -> None:
    self._open = False
    self._thread.join()
    self._harness._bundle_ended()
    error, end.error = end.error, None
    if error is not None:
      raise error
    self.response = end.response

  def close(self) -> None:
    """Aborts the bundle if it is still running; its harness is dropped."""
    if not self._open:
      return
    self._open = False
    self._out.abort()
    harness = self._harness
    harness.abandoned = True
    self._thread.join(ABORT_JOIN_SECS)
    if not self._thread.is_alive():
      harness._stop()  # pylint: disable=protected-access
    # else: stuck in user code; the thread shuts the harness down if it
    # ever returns.

  def __del__(self):
    with contextlib.suppress(Exception):
      self.close()


class EmbeddedHarness:
  """One SDK worker with one registered bundle descriptor."""
  _ids = itertools.count(1)
  # Output streams to the task as the bundle writes it; the runner does not
  # split its bundles.
  collects_output = False
  splits_bundles = False
  last_split = None

  def __init__(self, descriptor: beam_fn_api_pb2.ProcessBundleDescriptor):
    self.descriptor = descriptor
    self.harness_side = _HarnessChannel()
    self.runner_side = self.harness_side.inverse()
    self.state = DelegatingStateHandler()
    # The user-state cache is disabled (size 0): state lives in the task's
    # servicer, and a cache shared across tasks could serve another task's
    # values for the same key after a retry.
    cache = statecache.StateCache(0)
    self.processors = sdk_worker.BundleProcessorCache(
        worker_handlers.FNAPI_RUNNER_CAPABILITIES,
        worker_handlers.SingletonStateHandlerFactory(
            sdk_worker.GlobalCachingStateHandler(cache, self.state)),
        data_plane.InMemoryDataChannelFactory(self.harness_side),
        {descriptor.id: descriptor})
    self.worker = sdk_worker.SdkWorker(self.processors)
    self.last_used = time.monotonic()
    # Set once a bundle of it was aborted: it is not handed out again (no
    # lock taken: this may be set while the garbage collector closes an
    # abandoned reader).
    self.abandoned = False
    self._running = 0
    self._shutdown_lock = threading.RLock()
    self._shut_down = False

  def next_instruction_id(self) -> str:
    return 'bundle_%d' % next(self._ids)

  @classmethod
  def for_stage(cls, job_id: str, stage, components, job_options
                ) -> 'EmbeddedHarness':
    """The harness kind's factory (``worker.harnesses.KINDS``)."""
    return cls(beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
        stage.descriptor))

  def descriptor_for(self, stage_name: str, descriptor: bytes):
    return self.descriptor

  def process_bundle(self, descriptor, iid: str, data: dict, timers: dict,
                     expected: list, split=None,
                     cache_token: Optional[bytes] = None,
                     claim_limit: Optional[int] = None,
                     halve: bool = False) -> StreamedBundle:
    """Starts one bundle in a thread of its own; returns its output stream.
    ``claim_limit``: the claims its restriction trackers may succeed at
    before they checkpoint themselves (worker.endpoints); whether they ran
    out is the stream's ``claims_exhausted`` once it ended."""
    if self.abandoned:
      raise RuntimeError('this harness was dropped after an aborted bundle')
    send_input(self.runner_side, iid, data, timers)
    out = self.harness_side.queues[iid] = _OutputQueue()
    request = beam_fn_api_pb2.InstructionRequest(
        instruction_id=iid,
        process_bundle=beam_fn_api_pb2.ProcessBundleRequest(
            process_bundle_descriptor_id=descriptor.id,
            cache_tokens=user_state_tokens(cache_token)))
    name = BUNDLE_THREAD_PREFIX + iid
    budget = endpoints.set_claim_budget(name, claim_limit, halve)
    thread = threading.Thread(
        target=self._run_bundle, args=(request, out, name),
        name=name, daemon=True)
    self._running += 1
    try:
      thread.start()
    except BaseException:
      self._running -= 1
      self.harness_side.queues.pop(iid, None)
      endpoints.clear_claim_budget(name)
      raise
    return StreamedBundle(self, iid, out, thread, budget)

  def _run_bundle(self, request, out: _OutputQueue, name: str) -> None:
    response = error = None
    try:
      response = self.worker.do_instruction(request)
    except BaseException as exn:  # pylint: disable=broad-except
      error = exn  # raised in the reader's thread
    finally:
      self.harness_side.queues.pop(request.instruction_id, None)
      endpoints.clear_claim_budget(name)
    try:
      out.put(_End(response, error))
    except BundleAborted:
      pass
    del error
    if out.aborted:
      self._stop()

  def _bundle_ended(self) -> None:
    self._running -= 1
    self.last_used = time.monotonic()

  def in_use(self) -> bool:
    """A task holds it (its state target is set) or a bundle runs in it."""
    return self.state.target is not None or self._running > 0

  def do(self, request: beam_fn_api_pb2.InstructionRequest):
    return self.worker.do_instruction(request)

  def flush_logs(self) -> None:
    pass

  def dead(self):
    return None

  def reusable_after_error(self) -> bool:
    # A failed bundle may leave its DoFns in a bad state.
    return False

  def shutdown(self) -> None:
    """Stops it; an abandoned one is stopped by its aborted bundle's reader
    or, if that bundle is still stuck in user code, by its thread."""
    if self.abandoned:
      return
    self._stop()

  def _stop(self) -> None:
    with self._shutdown_lock:
      if self._shut_down:
        return
      self._shut_down = True
    self.processors.shutdown()
