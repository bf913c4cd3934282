"""Run one fused stage over one input partition, bundle by bundle.

The loop per task: feed input to the harness in bundles of bounded size;
feed self-checkpoint residuals back until none remain; then fire timers in
rounds until none remain. A bundle that asks for finalization is finalized
once its output has been handed downstream, before its residuals run.

A bundle's output is handed downstream as the harness writes it (the
in-process harness streams it; the gRPC harnesses collect it first, so
that a bundle whose channel failed can be retried): a bundle that fails
partway has already yielded some output, which Spark drops with the failed
task. Which harness runs the stage is the harness cache's business
(``worker.harnesses``); this module sees only the ``Harness`` interface.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import traceback
import uuid
from typing import Callable
from typing import Generator
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.metrics import monitoring_infos
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import metrics_pb2
from apache_beam.utils.timestamp import Timestamp

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.options import DEFAULT_SPLIT_AFTER_SECS
from beam_pyspark.planning.plan import DATA_INPUT_URN
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.streaming.timers import TimerTable
from beam_pyspark.worker import endpoints
from beam_pyspark.worker.endpoints import splittable_input
from beam_pyspark.worker import harnesses
from beam_pyspark.worker import sequence
from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.elements import split_elements
from beam_pyspark.worker.harnesses.base import transport_failure
from beam_pyspark.worker.inputs import Guarded
from beam_pyspark.worker.inputs import InputFailed
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.state import PerTaskState
from beam_pyspark.worker.state import StateBackend
from beam_pyspark.worker.state import StateEntries

_LOGGER = logging.getLogger(__name__)

DEFAULT_BUNDLE_BYTES = 32 << 20
# A residual asking to be resumed later is retried after at most this long:
# in batch nothing else can make progress for it meanwhile.
MAX_RESUME_DELAY_SECS = 0.5


# Output records of a stage that carry work split off a straggling bundle,
# to be run again in another task: (RESIDUAL_TAG, (input id, element)).
RESIDUAL_TAG = '\x00residual'


@dataclasses.dataclass
class TaskResult:
  """What a task reports besides its output: consolidated metrics."""
  monitoring_infos: list[metrics_pb2.MonitoringInfo]
  bundles: int


class StageRunner:
  def __init__(
      self,
      job_id: str,
      runtime: JobRuntime,
      stage: StagePlan,
      side_inputs: Iterable[StateEntries] = (),
      bundle_bytes: int = DEFAULT_BUNDLE_BYTES,
      on_finish: Optional[Callable[[TaskResult], None]] = None,
      pipeline_options: Optional[dict] = None,
      split_after_secs: float = DEFAULT_SPLIT_AFTER_SECS,
      state_backend: Optional[StateBackend] = None,
      timers: Optional[TimerTable] = None,
      clocks: Optional[tuple[Timestamp, Timestamp]] = None,
      limits: Optional[endpoints.Limits] = None,
      defer_finalization: Optional[Callable[[object, str], None]] = None):
    """``pipeline_options``: the job's, handed as they are to harnesses in
    their own processes; ``split_after_secs``: how long a splittable bundle
    runs before the runner splits it (0: never); ``state_backend``: where
    user state lives between tasks (batch: in the task only); ``timers``:
    the timers pending from earlier tasks (streaming; batch: none);
    ``clocks``: (input watermark, processing time) at which timers are due
    (streaming), or None for batch, where every timer fires once the input
    is exhausted. Timers not yet due stay in ``self.timers``.

    ``limits`` (streaming, a splittable stage): each bundle runs until it
    checkpoints itself or reaches its limits (``worker.endpoints``), and
    what it leaves is output as (RESIDUAL_TAG, Residual) records instead of
    being run again here; input records (ENDPOINT_TAG, Granted) run one
    endpoint each, with its own grant. ``defer_finalization(harness,
    instruction id)`` (streaming) takes the bundles to finalize once the
    micro-batch has committed, instead of finalizing them here."""
    self.job_id = job_id
    self.runtime = runtime
    self.stage = stage
    self.side_inputs = side_inputs
    self.bundle_bytes = bundle_bytes
    self.on_finish = on_finish
    self.pipeline_options = pipeline_options
    self.split_after_secs = split_after_secs
    self.state_backend = state_backend or PerTaskState()
    self._harness: Optional[harnesses.Harness] = None
    self._metrics: list[metrics_pb2.MonitoringInfo] = []
    self._bundles = 0
    self._batch = timers is None and clocks is None and limits is None
    self._timers = timers if timers is not None else TimerTable(
        {(t.transform_id, t.family_id): t.time_domain for t in stage.timers})
    self._clocks = clocks
    self._limits = limits
    self._defer_finalization = defer_finalization
    self._checkpoint: Optional[endpoints.Checkpointer] = None
    self._claims_exhausted = False
    self._position = None
    self._to_finalize: list[str] = []
    self._timer_impls = {
        (t.transform_id, t.family_id): runtime.coder_impl(t.coder_id)
        for t in stage.timers
    }

  def run(self, inputs: Iterable[tuple[str, bytes]]) -> Iterator[tuple[str, bytes]]:
    """Yields (output transform id, encoded chunk) for every DATA_OUTPUT."""
    # What the stage before this one in the task produces: its failure is
    # not this stage's to wrap or recover from (worker.inputs).
    inputs = Guarded(inputs)
    if self._batch:  # No input, no bundle: no harness (an empty partition).
      first = next(inputs, None)
      if first is None:
        if self.on_finish is not None:
          self.on_finish(TaskResult([], 0))
        return
      inputs = itertools.chain([first], inputs)
    h = self._acquire_harness()
    self._harness = h
    self._descriptor = h.descriptor_for(self.stage.name, self.stage.descriptor)
    self._expected = list(self.stage.outputs) + [
        (t.transform_id, t.family_id) for t in self.stage.timers]
    self._split = None
    after = self.split_after_secs
    if after > 0 and h.splits_bundles and self._limits is None:
      split_input = splittable_input(self._descriptor)
      if split_input is not None:
        self._split = (split_input, after, self.runtime.coder_impl(
            self.stage.input_coders[split_input]))
    self._state = self.state_backend.open(
        self.side_inputs, journaled=self.stage.stateful)
    # The harness may cache this task's user state across its bundles.
    self._cache_token = (
        f'{self.job_id}/{uuid.uuid4().hex}'.encode('utf-8')
        if self.stage.stateful else None)
    h.state.target = self._state
    succeeded = False
    try:
      pending: dict[str, list[bytes]] = {}
      size = 0
      for transform_id, data in inputs:
        if transform_id == endpoints.ENDPOINT_TAG:
          # An endpoint of a streaming read: a bundle of its own, its grant.
          if pending:
            yield from self._bundle(pending, {})
            pending, size = {}, 0
          yield from self._limited_bundle(
              {data.input_id: [data.element]}, {},
              endpoints.Limits(data.grant, self._limits.secs,
                               data.grant_bytes, self._limits.compact),
              data.endpoint_id, data.split)
          continue
        if type(data) is sequence.Offsets:  # pylint: disable=unidiomatic-typecheck
          # A sequence read's compact chunk, here read by a harness.
          data = data.encode(sequence.port_impl(self._descriptor,
                                                transform_id))
        pending.setdefault(transform_id, []).append(data)
        size += len(data)
        if size >= self.bundle_bytes:
          yield from self._bundle(pending, {})
          pending, size = {}, 0
      if pending:
        yield from self._bundle(pending, {})
      while True:
        if self._clocks is None:
          due = self._timers.take_round()
        else:
          due = self._timers.take_due(*self._clocks)
        if not due:
          break
        yield from self._bundle({}, due)
      succeeded = True
    except InputFailed:
      raise  # the producer's failure; this stage's harness is sound
    except PipelineExecutionError:
      self._discard_harness()
      raise
    except Exception as exn:  # the user's code raised inside the harness
      self._discard_harness()
      # The fused stage's name lists every transform in it; Beam's error
      # already names the failing one ("[while running 'X']").
      raise PipelineExecutionError(
          f'{exn}\n{traceback.format_exc()}') from exn
    finally:
      self._harness.flush_logs()
      self._harness.state.target = None
      self.state_backend.close(self._state, succeeded)
    if self.on_finish is not None:
      self.on_finish(
          TaskResult(
              list(monitoring_infos.consolidate(self._metrics)), self._bundles))

  @property
  def timers(self) -> TimerTable:
    """The stage's pending timers (after ``run``: those not yet due)."""
    return self._timers

  def _bundle(self, data, timers,
              limits: Optional[endpoints.Limits] = None
              ) -> Iterator[tuple[str, bytes]]:
    """One bundle, then its residuals until none remain (streaming: its
    residuals are output for a later micro-batch)."""
    if self._limits is not None:
      yield from self._limited_bundle(data, timers, limits or self._limits)
      return
    while True:
      response = yield from self._process(data, timers)
      yield from self._split_residuals(data)
      # The bundle's output is handed downstream by now: finalize it before
      # its residuals run, as they may wait for the finalization.
      self._finalize()
      residuals = response.process_bundle.residual_roots
      if not residuals:
        return
      data, timers = {}, {}
      delay = 0.0
      for residual in residuals:
        app = residual.application
        input_id = self._input_for(app.transform_id, app.input_id)
        data.setdefault(input_id, []).append(app.element)
        if residual.HasField('requested_time_delay'):
          delay = max(delay, residual.requested_time_delay.ToTimedelta().total_seconds())
      if delay > 0:
        time.sleep(min(delay, MAX_RESUME_DELAY_SECS))

  def _limited_bundle(self, data, timers, limits: endpoints.Limits,
                      endpoint_id: Optional[str] = None, halve: bool = False
                      ) -> Iterator[tuple[str, object]]:
    """One bundle of a streaming splittable stage within ``limits``
    (``halve``: its restriction split in two as it starts); what it leaves
    (self-checkpoints, the runner's splits) as residuals, the first of
    them the endpoint ``endpoint_id`` carried on."""
    found = sequence.bundle_read(self._descriptor, data, timers, limits)
    if found is not None:  # PeriodicImpulse's offsets, a grant at a time
      yield from found[0].read(found[1], limits, endpoint_id, self._metrics)
      self._bundles += 1
      return
    parent = [endpoint_id]

    def heir() -> Optional[str]:
      return parent.pop() if parent else None

    try:
      response = yield from self._process(data, timers, limits, halve,
                                          endpoint_id)
    finally:
      # Also when the bundle failed: its checkpointer polls no more.
      checkpoint, self._checkpoint = self._checkpoint, None
      splits = checkpoint.stop() if checkpoint else []
    self._finalize()
    runtime, coders = self.runtime, self.stage.input_coders
    # Its own checkpoints; busy if they were the claim budget's.
    busy = self._claims_exhausted
    for root in response.process_bundle.residual_roots:
      app = root.application
      input_id = self._input_for(app.transform_id, app.input_id)
      delay = (root.requested_time_delay.ToMicroseconds()
               if root.HasField('requested_time_delay') else 0)
      yield endpoints.RESIDUAL_TAG, endpoints.residual(
          runtime, coders[input_id], input_id, app, delay, heir(), busy,
          self._position)
    # The runner's splits (a halving, or its grant ran out: busy).
    busy = len(splits) > 1 or bool(checkpoint and checkpoint.by_grant)
    for root in (r for split in splits for r in split.residual_roots):
      app = root.application
      input_id = self._input_for(app.transform_id, app.input_id)
      yield endpoints.RESIDUAL_TAG, endpoints.residual(
          runtime, coders[input_id], input_id, app, parent=heir(), busy=busy,
          position=self._position)
    for channel in (c for split in splits for c in split.channel_splits):
      transform_id = channel.transform_id
      impl = runtime.coder_impl(coders[transform_id])
      for index, element in enumerate(
          split_elements(impl, data.get(transform_id, ()))):
        if index >= channel.first_residual_element:
          yield endpoints.RESIDUAL_TAG, endpoints.unread(
              runtime, coders[transform_id], transform_id, element)

  def _watch(self, limits: endpoints.Limits, halve: bool = False,
             endpoint_id: Optional[str] = None):
    """A function starting the checkpointer of a bundle (its id given)."""
    found = endpoints.splittable_transform(self._descriptor)
    input_id = splittable_input(self._descriptor)
    if found is None or input_id is None:
      return None
    counted = found[1]

    def watch(instruction_id: str, budget=None, fail=None
              ) -> endpoints.Checkpointer:
      def hung(secs: float) -> None:
        fail(f'A streaming read of stage {self.stage.name!r} ran {secs:.0f} '
             f's in one bundle without returning (endpoint {endpoint_id}): '
             'its splittable DoFn neither finished nor claimed, so the runner '
             'could not checkpoint it. The job stops rather than wait for '
             'ever: a DoFn that waits for data should return '
             'ProcessContinuation.resume() (or defer_remainder) meanwhile.')

      self._checkpoint = endpoints.Checkpointer(
          self._harness, instruction_id, input_id, counted, limits,
          halve, budget, hung if fail is not None else None).start()
      return self._checkpoint

    return watch

  def _process(
      self, data, timers, limits: Optional[endpoints.Limits] = None,
      halve: bool = False, endpoint_id: Optional[str] = None
  ) -> Generator[tuple[str, bytes], None, beam_fn_api_pb2.InstructionResponse]:
    """Runs one bundle: yields its data output as the harness writes it and
    records the timers it sets; returns its response, once all of its output
    has been read."""
    fired_timers = {}
    for spec in self.stage.timers:
      key = (spec.transform_id, spec.family_id)
      fired = timers.get(key)
      fired_timers[key] = (
          list(encode_stream(self._timer_impls[key], fired)) if fired else [])
    # Every input and timer stream is sent, closed, even when empty: a
    # harness over gRPC waits for the end of each.
    inputs = {t: data.get(t, ()) for t in self.stage.inputs}
    watch = (self._watch(limits, halve, endpoint_id)
             if limits is not None and data else None)
    claims = limits.records if watch is not None else None
    output = self._start(inputs, fired_timers, watch, claims,
                         halve and watch is not None)
    try:
      for element in output:
        if isinstance(element, beam_fn_api_pb2.Elements.Timers):
          key = (element.transform_id, element.timer_family_id)
          self._timers.written(
              *key, decode_all(self._timer_impls[key], [element.timers]))
        else:
          chunk = element.data
          if chunk:
            transform_id = element.transform_id
            del element  # not held while downstream consumes the chunk
            yield transform_id, chunk
    finally:
      # Aborts the bundle if its output was not read to the end.
      output.close()
    response = output.response
    if response.error:
      raise PipelineExecutionError(response.error)
    self._claims_exhausted = getattr(output, 'claims_exhausted', False)
    budget = getattr(output, 'claim_budget', None)
    self._position = budget.position if budget is not None else None
    self._bundles += 1
    self._metrics.extend(response.process_bundle.monitoring_infos)
    if response.process_bundle.requires_finalization:
      self._to_finalize.append(output.instruction_id)
    return response

  def _start(self, inputs, fired_timers, watch=None,
             claims: Optional[int] = None,
             halve: bool = False) -> harnesses.BundleOutput:
    """Starts a bundle on the task's harness; ``watch(instruction id)``
    starts watching it once it runs (streaming reads' checkpoints);
    ``claims``: what its restriction trackers may claim (an in-process
    harness enforces it, worker.endpoints)."""
    h = self._harness
    iid = h.next_instruction_id()
    if not h.collects_output:
      extra = {} if watch is None else {'claim_limit': claims,
                                         'halve': halve}
      output = h.process_bundle(
          self._descriptor, iid, inputs, fired_timers, self._expected,
          split=self._split, cache_token=self._cache_token, **extra)
      if watch is not None:
        watch(iid, getattr(output, 'claim_budget', None),
              getattr(output, 'fail', None))
      return output
    if watch is not None:
      # This harness runs the bundle to its end in process_bundle: it
      # starts the watch itself once the bundle is sent.
      output = h.process_bundle(
          self._descriptor, iid, inputs, fired_timers, self._expected,
          split=self._split, cache_token=self._cache_token, watch=watch)
      if output.response.error:
        raise PipelineExecutionError(output.response.error)
      return output
    # This harness's bundle has run when process_bundle returns, its output
    # collected: a transport failure can still be retried. The bundle's
    # user state writes are journaled, so that a retry starts from the
    # state the failed attempt started from (other stages only read side
    # inputs).
    journal = self.stage.stateful
    if journal:
      self._state.begin_bundle()
    try:
      try:
        output = h.process_bundle(
            self._descriptor, iid, inputs, fired_timers, self._expected,
            split=self._split, cache_token=self._cache_token)
        error = output.response.error
        lost = transport_failure(error) if error else None
      except harnesses.HarnessLostError as exn:
        lost = str(exn)
      if lost is not None:
        # The harness lost a channel to this task's Fn API servers (its
        # state or data stream: Beam's harness keeps a failed stream's error
        # for good), or went away (its process died, its control stream
        # ended). Nothing of the bundle was kept: as a task retry would,
        # run it again on a fresh harness (new servers, new channels).
        _LOGGER.warning(
            'Bundle %s of %s lost its harness or Fn API channel (%s); '
            'retrying it once on a new harness', iid, self.stage.name, lost)
        if journal:
          self._state.rollback_bundle()
          self._state.begin_bundle()
        harnesses.discard(self.job_id, self.stage, self.runtime.components)
        h = self._harness = self._acquire_harness()
        h.state.target = self._state
        self._descriptor = h.descriptor_for(
            self.stage.name, self.stage.descriptor)
        iid = h.next_instruction_id()
        output = h.process_bundle(
            self._descriptor, iid, inputs, fired_timers, self._expected,
            split=self._split, cache_token=self._cache_token)
    finally:
      # A failed bundle fails its task, whose state goes with it.
      if journal:
        self._state.commit_bundle()
    return output

  def _split_residuals(self, data) -> Iterator[tuple[str, tuple[str, bytes]]]:
    """What a runner-initiated split took from the last bundle, as
    (RESIDUAL_TAG, (input transform id, encoded element)) records for
    another task: the residual roots, and the input elements past the
    channel split that the bundle will not read."""
    result = self._harness.last_split
    if result is None:
      return
    self._harness.last_split = None
    for residual in result.residual_roots:
      app = residual.application
      yield RESIDUAL_TAG, (
          self._input_for(app.transform_id, app.input_id), app.element)
    for channel in result.channel_splits:
      transform_id = channel.transform_id
      impl = self.runtime.coder_impl(self.stage.input_coders[transform_id])
      for index, element in enumerate(
          split_elements(impl, data.get(transform_id, ()))):
        if index >= channel.first_residual_element:
          yield RESIDUAL_TAG, (transform_id, element)

  def _acquire_harness(self) -> harnesses.Harness:
    return harnesses.acquire(self.job_id, self.stage, self.runtime.components,
                             self.pipeline_options)

  def _discard_harness(self) -> None:
    """After a failure: the cache drops the harness unless it may be
    reused (a gRPC harness that a user error left alive is)."""
    harnesses.discard_after_error(self.job_id, self.stage,
                                  self.runtime.components, self._harness)

  def _finalize(self) -> None:
    h = self._harness
    if self._defer_finalization is not None:
      for iid in self._to_finalize:
        self._defer_finalization(h, iid)
      self._to_finalize.clear()
      return
    while self._to_finalize:
      response = h.do(
          beam_fn_api_pb2.InstructionRequest(
              instruction_id=h.next_instruction_id(),
              finalize_bundle=beam_fn_api_pb2.FinalizeBundleRequest(
                  instruction_id=self._to_finalize.pop(0))))
      if response.error:
        raise PipelineExecutionError(response.error)

  def _input_for(self, transform_id: str, input_id: str) -> str:
    """The DATA_INPUT transform whose elements feed (transform, input)."""
    transforms = self._descriptor.transforms
    pcoll = transforms[transform_id].inputs[input_id]
    for read_id, proto in transforms.items():
      if proto.spec.urn == DATA_INPUT_URN and pcoll in proto.outputs.values():
        return read_id
      if (proto.spec.urn
          == common_urns.sdf_components.TRUNCATE_SIZED_RESTRICTION.urn and
          pcoll in proto.outputs.values()):
        return self._input_for(read_id, next(iter(proto.inputs)))
    raise PipelineExecutionError(
        f'No data input of stage {self.stage.name!r} feeds {transform_id!r}')
