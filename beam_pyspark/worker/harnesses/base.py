"""What every SDK harness kind shares with the runner's side of a bundle.

``Harness`` is the interface ``worker.bundles.StageRunner`` drives; a
bundle's output is a ``BundleOutput`` whichever harness ran it. State
requests reach the task's servicer through a ``DelegatingStateHandler``
whose target is swapped per task (a PySpark Python worker runs one task at
a time).
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from typing import Optional
from typing import Protocol
from typing import Union

from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.worker import sdk_worker

from beam_pyspark.errors import PipelineExecutionError

OutputElement = Union[beam_fn_api_pb2.Elements.Data,
                      beam_fn_api_pb2.Elements.Timers]

class HarnessLostError(PipelineExecutionError):
  """The harness went away while it ran a bundle (its process died, or
  its control stream ended): nothing of the bundle was kept, so the bundle
  may run once more on a new harness."""


_TRANSPORT_FAILURES = (
    'Channel closed prematurely', 'failed to connect to all addresses',
    'Stream removed (Socket closed)')


def transport_failure(error: str) -> Optional[str]:
  """If a harness's error is its Fn API channel failing, not user code:
  the line of it that names the channel's failure."""
  for line in error.splitlines():
    if any(marker in line for marker in _TRANSPORT_FAILURES):
      return line.strip()
  return None


class BundleOutput(Protocol):
  """What a harness's ``process_bundle`` returns.

  Iterate it once for the bundle's output: ``Elements.Data`` and
  ``Elements.Timers``, in the order the harness wrote them.  Once the
  iteration has ended, ``response`` is the bundle's InstructionResponse;
  an error of the bundle's code is either raised by the iteration or in
  ``response.error``.  ``close()`` gives up on the rest of the output.
  """
  instruction_id: str
  response: Optional[beam_fn_api_pb2.InstructionResponse]

  def __iter__(self) -> Iterator[OutputElement]:
    ...

  def close(self) -> None:
    ...


class CollectedBundle:
  """A BundleOutput of a bundle that has already run: its response and
  its output, held (the gRPC harnesses, harnesses.remote, return these)."""
  def __init__(self, instruction_id: str, response, elements):
    self.instruction_id = instruction_id
    self.response = response
    self._elements = elements

  def __iter__(self) -> Iterator[OutputElement]:
    return iter(self._elements)

  def close(self) -> None:
    self._elements = ()


class Harness(Protocol):
  """One SDK harness, as the runner's side of a stage drives it.

  ``collects_output``: a bundle's output is held until the bundle ended
  (the gRPC harnesses), so a bundle whose Fn API channel failed left
  nothing downstream and can be run again on a new harness; the in-process
  harness streams output instead. ``splits_bundles``: the runner may split
  its straggling splittable bundles (``process_bundle(split=...)``), the
  split's response then in ``last_split``.
  """
  state: 'DelegatingStateHandler'
  last_split: Optional[beam_fn_api_pb2.ProcessBundleSplitResponse]
  last_used: float
  collects_output: bool
  splits_bundles: bool

  def descriptor_for(
      self, stage_name: str,
      descriptor: bytes) -> beam_fn_api_pb2.ProcessBundleDescriptor:
    """The stage's descriptor, registered with this harness."""

  def next_instruction_id(self) -> str:
    ...

  def process_bundle(self, descriptor, iid: str, data: dict, timers: dict,
                     expected: list, split=None,
                     cache_token: Optional[bytes] = None) -> 'BundleOutput':
    """Starts (or runs) one bundle with this input and timers.

    ``cache_token``: the user-state cache token of the task's state (the
    harness may cache what it reads and writes under it; a new token per
    task, since state loaded into a task may differ from what a harness
    saw before)."""

  def do(self, request: beam_fn_api_pb2.InstructionRequest
         ) -> beam_fn_api_pb2.InstructionResponse:
    """Any other instruction (finalization, progress, split)."""

  def flush_logs(self) -> None:
    """Waits briefly for log entries the harness is still sending."""

  def dead(self) -> Optional[str]:
    """Why the harness is gone (its process exited...), or None."""

  def in_use(self) -> bool:
    """A task holds it or one of its bundles runs."""

  def reusable_after_error(self) -> bool:
    """Whether a task may use it again after a bundle failed in it."""

  def shutdown(self) -> None:
    ...


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


def user_state_tokens(token: Optional[bytes]) -> list:
  """The ProcessBundleRequest cache tokens for a task's user state."""
  if token is None:
    return []
  return [beam_fn_api_pb2.ProcessBundleRequest.CacheToken(
      user_state=beam_fn_api_pb2.ProcessBundleRequest.CacheToken.UserState(),
      token=token)]


def name_channel_splits(split: beam_fn_api_pb2.ProcessBundleSplitResponse,
                        input_id: str
                        ) -> beam_fn_api_pb2.ProcessBundleSplitResponse:
  """The split's channel splits, each naming the data input it splits.

  Beam's Java harness leaves ``ChannelSplit.transform_id`` empty
  (``BeamFnDataReadRunner.trySplit``: Beam's Java runners ask one input a
  bundle); the runner asked ``input_id`` alone, so an unnamed channel
  split is that input's. Without this a Java unbounded read's checkpoint
  failed its task with KeyError ''."""
  for channel in split.channel_splits:
    if not channel.transform_id:
      channel.transform_id = input_id
  return split
