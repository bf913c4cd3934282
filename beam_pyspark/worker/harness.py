"""The in-process Beam Python SDK harness, cached per stage per process.

This is the harness that Beam's EmbeddedWorkerHandler drives: an SdkWorker
over a BundleProcessorCache, talking through an in-memory data channel.
Creating one costs descriptor parsing and DoFn setup, so it is kept for the
life of the Python worker and reused by every task of the same stage.  State
requests go to a delegating handler whose target is swapped per task, since a
PySpark Python worker runs one task at a time.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from typing import Optional

from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.worker import data_plane
from apache_beam.runners.worker import sdk_worker
from apache_beam.runners.worker import statecache

_MAX_HARNESSES = 32
_lock = threading.Lock()
_harnesses: 'collections.OrderedDict[tuple, EmbeddedHarness]' = (
    collections.OrderedDict())


class DelegatingStateHandler(sdk_worker.StateHandler):
  """Forwards state requests to the current task's state servicer."""
  def __init__(self):
    self.target: Optional[sdk_worker.StateHandler] = None

  def _t(self):
    if self.target is None:
      raise RuntimeError('no state servicer is attached to this harness')
    return self.target

  def get_raw(self, state_key, continuation_token=None):
    return self._t().get_raw(state_key, continuation_token)

  def append_raw(self, state_key, data):
    return self._t().append_raw(state_key, data)

  def clear(self, state_key):
    return self._t().clear(state_key)

  @contextlib.contextmanager
  def process_instruction_id(self, bundle_id):
    with self._t().process_instruction_id(bundle_id):
      yield

  def done(self):
    pass


def send_input(channel, iid: str, data: dict, timers: dict) -> None:
  """Writes and closes every timer and data stream of bundle ``iid``."""
  for (transform_id, family_id), chunks in timers.items():
    out = channel.output_timer_stream(iid, transform_id, family_id)
    for chunk in chunks:
      out.write(chunk)
    out.close()
  for transform_id, chunks in data.items():
    out = channel.output_stream(iid, transform_id)
    for chunk in chunks:
      out.write(chunk)
    out.close()


class EmbeddedHarness:
  """One SDK worker with one registered bundle descriptor."""
  _ids = itertools.count(1)

  def __init__(self, descriptor: beam_fn_api_pb2.ProcessBundleDescriptor):
    self.descriptor = descriptor
    self.runner_side = data_plane.InMemoryDataChannel()
    self.state = DelegatingStateHandler()
    # The user-state cache is disabled (size 0): state lives in the task's
    # servicer, and a cache shared across tasks could serve another task's
    # values for the same key after a retry.
    cache = statecache.StateCache(0)
    self.processors = sdk_worker.BundleProcessorCache(
        worker_handlers.FNAPI_RUNNER_CAPABILITIES,
        worker_handlers.SingletonStateHandlerFactory(
            sdk_worker.GlobalCachingStateHandler(cache, self.state)),
        data_plane.InMemoryDataChannelFactory(self.runner_side.inverse()),
        {descriptor.id: descriptor})
    self.worker = sdk_worker.SdkWorker(self.processors)

  def next_instruction_id(self) -> str:
    return 'bundle_%d' % next(self._ids)

  def descriptor_for(self, stage_name: str, descriptor: bytes):
    return self.descriptor

  # Bundles run synchronously in this thread: none is split while running.
  last_split = None

  def process_bundle(self, descriptor, iid: str, data: dict, timers: dict,
                     expected: list, split=None):
    """Runs one bundle in process; returns (response, output elements)."""
    send_input(self.runner_side, iid, data, timers)
    response = self.do(
        beam_fn_api_pb2.InstructionRequest(
            instruction_id=iid,
            process_bundle=beam_fn_api_pb2.ProcessBundleRequest(
                process_bundle_descriptor_id=descriptor.id)))
    return response, list(self.runner_side.input_elements(iid, expected))

  def do(self, request: beam_fn_api_pb2.InstructionRequest):
    return self.worker.do_instruction(request)

  def flush_logs(self) -> None:
    pass

  def dead(self):
    return None

  def shutdown(self) -> None:
    self.processors.shutdown()


def harness_for(job_id: str, stage_name: str, descriptor: bytes) -> EmbeddedHarness:
  key = (job_id, stage_name)
  with _lock:
    harness = _harnesses.get(key)
    if harness is None:
      harness = EmbeddedHarness(
          beam_fn_api_pb2.ProcessBundleDescriptor.FromString(descriptor))
      _harnesses[key] = harness
      while len(_harnesses) > _MAX_HARNESSES:
        _, old = _harnesses.popitem(last=False)
        old.shutdown()
    else:
      _harnesses.move_to_end(key)
    return harness


def discard_harness(job_id: str, stage_name: str) -> None:
  """Drop a harness after a failure: its DoFns may be in a bad state."""
  with _lock:
    harness = _harnesses.pop((job_id, stage_name), None)
  if harness is not None:
    try:
      harness.shutdown()
    except Exception:  # pylint: disable=broad-except
      pass


def release_job(job_id: str) -> None:
  with _lock:
    keys = [k for k in _harnesses if k[0] == job_id]
    harnesses = [_harnesses.pop(k) for k in keys]
  for h in harnesses:
    h.shutdown()
