"""A fused batch stage run as one plain loop, the SDK harness as fallback.

``planning.fastpath`` chose the stage on its protos; here each task loads
its functions (``chain.load``), reads its partition (the bounded source's
splits, or encoded elements) and runs the compiled loop over it. What the
loop writes is what the harness would (``sinks``): elements encoded with
the stage's output coder (the shuffle's records for a GroupByKey with the
default windowing, packed as ``RunStage`` packs the harness's), the
precombine's accumulators (Beam's own, emitted when the table holds too
many keys, as ``PGBKCVOperation`` does, and at the end), and Beam's
element count per PCollection. Side inputs are read whole from the
task's state entries and handed to the callables as the plain values
their views make (a dict for ``AsDict``, a list for ``AsList``...).

Beam's own file writer (``WriteToText``'s ``WriteBundles``) is run as the
loop's sink, a task being its bundle (``sinks.Writer``). A chain that
stops short of the stage's output (a transform the loop cannot run: a
DoFn of the user's own) hands its last PCollection's elements to the
harness, which runs the rest of the stage in the same task
(``FastPath.rest_stage``).

Whatever the loop cannot keep hands the rest of the partition to the
harness, from the element where it happened: an output that is a
WindowedValue, TimestampedValue or TaggedOutput, a metric update, any
exception from the user's code (the harness then raises Beam's own
"[while running 'X']" error, with the user's traceback). That element's
outputs were held back, so nothing of it was written twice; the loop's
output before it stands. Two cases cannot go on so:

* the source itself updated a metric or read special values, or the
  combine or an encoder failed while taking an element's outputs in part:
  the whole partition reruns on the harness, if nothing has left the task
  yet;
* otherwise a failure reruns the partition on the harness (its output
  dropped) to raise the harness's own error, and anything else fails the
  task, and Spark's retry of it takes the harness (``RunStage`` runs the
  loop in a task's first attempt only).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.coders import coders
from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.metrics import monitoring_infos
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.pvalue import SideInputData
from apache_beam.runners.worker import statesampler
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.fastpath import FastPath
from beam_pyspark.planning.fastpath import examine
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.worker.bundles import TaskResult
from beam_pyspark.worker.elements import CHUNK_BYTES
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.fastpath.sinks import Sink
from beam_pyspark.worker.fastpath.sinks import Writer
from beam_pyspark.worker.reads import read_split
from beam_pyspark.worker.runtime import JobRuntime

_LOGGER = logging.getLogger(__name__)

# Input kept in memory so that the whole partition can run again on the
# harness: a read's splits always fit; encoded elements up to this much.
REPLAY_BYTES = 64 << 20

# Types checked once: not a WindowedValue, TimestampedValue or TaggedOutput.
_PLAIN: set = {str, bytes, int, float, bool, tuple, list, dict, type(None)}

# StageRunner(plan, on_finish) -> its run(records) is the harness's output.
HarnessFactory = Callable[[StagePlan, Callable[[TaskResult], None]], object]


def _check(x) -> None:
  if chains.is_special(x):
    raise chains.SpecialOutput(f'an output is a {type(x).__name__}')
  _PLAIN.add(type(x))


def _special_record(x) -> bool:
  if chains.is_special(x):
    return True
  _PLAIN.add(type(x))
  return False


class _Watch:
  """The thread's metrics tracker while the loop runs: Beam's metric
  updates (``MetricUpdater``) and anyone asking for the current metrics
  container only mark it touched."""
  __slots__ = ('touched', )

  def __init__(self):
    self.touched = False

  def update_metric(self, typed_metric_name, value) -> None:
    self.touched = True

  def current_state(self):
    # Asked for by code about to update the container itself: the update
    # goes to a throwaway one, and the harness does the element again.
    self.touched = True
    return _ThrowawayState()


class _ThrowawayState:
  def __init__(self):
    from apache_beam.metrics.execution import MetricsContainer  # pylint: disable=import-outside-toplevel
    self.metrics_container = MetricsContainer('fast path')
    self.name_context = None


class _Replay:
  """The task's input records, kept while they fit in ``budget`` bytes."""
  def __init__(self, records: Iterable, budget: int):
    self._records = iter(records)
    self._budget = budget
    self._size = 0
    self.kept: Optional[list] = []

  def __iter__(self):
    for record in self._records:
      if self.kept is not None:
        self.kept.append(record)
        self._size += len(record[1])
        if self._size > self._budget:
          self.kept = None
      yield record

  def again(self) -> Optional[Iterator]:
    """Every record from the first, or None if some were not kept."""
    if self.kept is None:
      return None
    return itertools.chain(list(self.kept), self._records)


class FastStage:
  """One task's run of a fast-path stage (see the module's docstring).

  ``group``: (reduce partitions, compact) when the output feeds a
  GroupByKey. ``side_inputs``: the task's side input state entries (a
  list per side input, as StageRunner takes them).
  Yields (output id, chunk) where a chunk is bytes of encoded elements
  (the caller keys them for a shuffle as it keys the harness's) or, for
  compact shuffle records written by the loop itself, an already packed
  (reduce partition, chunk).
  """
  def __init__(self, runtime: JobRuntime, stage: StagePlan, spec: FastPath,
               group: Optional[tuple[int, bool]] = None,
               side_inputs: Iterable = ()):
    self.runtime = runtime
    self.stage = stage
    self.spec = spec
    self.group = group
    self.side_inputs = side_inputs
    self._emitted = False
    self._fed = False
    self._splits = 0
    self._whole_on_harness = False
    self._fallback: Optional[chains.Fallback] = None
    self._sink: Optional[Sink] = None
    self._writer: Optional[Writer] = None
    self._loop_counts: list[int] = []

  def run(self, records: Iterable, harness: HarnessFactory,
          on_finish: Callable[[TaskResult], None]) -> Iterator:
    spec = self.spec
    try:
      chain = chains.load(spec, self.runtime.context)
    except chains.NotEligible as exn:
      _LOGGER.debug('%s runs on the SDK harness: %s', self.stage.name, exn)
      yield from harness(self.stage, on_finish).run(records)
      return
    results: list[TaskResult] = []
    replay = _Replay(records, REPLAY_BYTES)
    chain.setup()
    try:
      if spec.rest_stage is not None:
        # The harness runs the rest of the stage on the loop's output.
        outputs = harness(spec.rest_stage, results.append).run(
            self._feed(chain, replay))
      else:
        outputs = ((spec.output_id, item)
                   for item in self._guarded(chain, replay))
      for item in outputs:
        self._emitted = True
        yield item
      fallback = self._fallback
      if fallback is not None and fallback.kind == chains.CLEAN:
        yield from harness(self._rest_stage(), results.append).run(
            self._rest(fallback))
      elif fallback is not None:
        yield from self._fall_back(fallback, replay, harness, results)
    finally:
      chain.teardown()
    infos = [] if self._whole_on_harness else [
        monitoring_infos.int64_counter(
            monitoring_infos.ELEMENT_COUNT_URN, count, pcollection=pcoll)
        for pcoll, count in zip(spec.pcollections(), self._counts())]
    for result in results:
      infos.extend(result.monitoring_infos)
    on_finish(
        TaskResult(list(monitoring_infos.consolidate(infos)),
                   sum(r.bundles for r in results)))

  def _feed(self, chain: chains.Chain, replay: _Replay) -> Iterator:
    """The loop's output as the rest stage's input. Once it has had some,
    the partition cannot run again whole: the rest stage has run bundles
    (their side effects, a sink's files, are done)."""
    for chunk in self._guarded(chain, replay):
      self._fed = True
      yield self.spec.input_id, chunk

  def _guarded(self, chain: chains.Chain, replay: _Replay) -> Iterator:
    """The loop's output; where it falls back, the sink's content (if the
    fallback is CLEAN), and the fallback kept for ``run``. The thread's
    metrics tracker is the loop's only while the loop runs."""
    watch = _Watch()
    saved = statesampler.get_current_tracker()
    loop = self._loop(chain, watch, replay)
    try:
      while True:
        statesampler.set_current_tracker(watch)
        try:
          item = next(loop)
        except StopIteration:
          return
        finally:
          statesampler.set_current_tracker(saved)
        yield item
    except chains.Fallback as exn:
      self._fallback = exn
    except Exception as exn:  # pylint: disable=broad-except
      # Reading the input failed (the source, a decoder, a side input).
      self._fallback = chains.Fallback(chains.UNCLEAN, None, None, exn)
    if self._fallback.kind == chains.CLEAN:
      _LOGGER.info('%s continues on the SDK harness (%s)', self.stage.name,
                   _why(self._fallback))
      try:
        yield from self._end()
        return
      except chains.Fallback as exn:
        self._fallback = exn
    if self._writer is not None:
      # Its file is not output: the harness writes the partition again,
      # or the task fails.
      try:
        self._writer.abandon()
      except Exception:  # pylint: disable=broad-except
        _LOGGER.debug('Closing an abandoned file writer failed',
                      exc_info=True)

  def _counts(self) -> list[int]:
    """Elements the loop committed per PCollection (spec.pcollections());
    the rest stage counts the boundary's."""
    counts = [self._splits] if self.spec.read_pcoll else []
    counts += self._loop_counts
    if self._writer is not None:
      counts += self._writer.counts
    if self._sink is not None and self._sink.table is not None:
      counts.append(self._sink.accumulators)
    if self.spec.rest_stage is not None:
      counts.pop()
    return counts

  # -- the loop -------------------------------------------------------------

  def _loop(self, chain: chains.Chain, watch: _Watch, replay: _Replay):
    spec = self.spec
    runtime = self.runtime
    read = bool(spec.read_pcoll)
    if spec.rest_stage is not None:
      coder, group = coders.WindowedValueCoder(
          runtime.coder(spec.boundary_coder_id),
          runtime.coder(spec.boundary_window_coder_id)), None
    else:
      coder, group = runtime.coder(spec.output_coder_id), self.group
    self._sink = sink = Sink(coder, group, chain, CHUNK_BYTES)
    calls, kind, names = chain.calls, sink.kind, dict(sink.names)
    at = next((i for i, c in enumerate(calls) if c.writer is not None), None)
    if at is not None:
      # A file writer takes the elements; what it outputs goes on through
      # the calls after it.
      writer_call, calls = calls[at], calls[:at]
      init_result, = self._side_values(writer_call)
      self._writer = Writer(writer_call, init_result, chain.calls[at + 1:],
                            sink)
      kind, names = chains.WRITE, dict(self._writer.names)
    self._loop_counts = [0] * (len(calls) + 1)
    names.update(plain=_PLAIN, check=_check, watch=watch,
                 counts=self._loop_counts, special_record=_special_record)
    extra = []
    for i, call in enumerate(calls):
      names[f'f{i}'] = call.fn
      args, kwargs = call.with_side_inputs(self._side_values(call))
      names[f'a{i}'], names[f'k{i}'] = args, kwargs
      extra.append(', '.join(([f'*a{i}'] if args else []) +
                             ([f'**k{i}'] if kwargs else [])))
    run = chains.compile_loop(
        [call.single for call in calls], kind,
        chain.combine_kind if kind == chains.TABLE else '',
        windowed=not read, read=read, names=names, extra=extra,
        identity=[call.identity for call in calls])
    self._elements = elements = _decode(
        runtime.coder_impl(spec.input_coder_id), replay)
    if read:
      for meta in elements:
        self._splits += 1
        records = read_split(meta.value)
        self._current = (meta, records)
        yield from run(records, meta)
    else:
      yield from run(elements, None)
    yield from self._end()

  def _end(self) -> Iterator:
    """The bundle's end: the file writer's last file, then the sink's
    table and streams (an UNCLEAN Fallback if that fails)."""
    if self._writer is not None:
      try:
        self._writer.finish()
      except Exception as exn:  # pylint: disable=broad-except
        raise chains.Fallback(chains.UNCLEAN, None, None, exn) from exn
    yield from self._sink.flush()

  def _side_values(self, call: chains.Call) -> list:
    """The call's side inputs as their views make them, from every element
    the task's state entries hold for them (the global window's)."""
    values = []
    for side in call.side_inputs:
      step = next(s for s in self.spec.steps
                  if side in s.side_inputs)
      data = []
      for key, value in itertools.chain.from_iterable(self.side_inputs):
        state_key = beam_fn_api_pb2.StateKey.FromString(key)
        iterable = state_key.iterable_side_input
        if (state_key.WhichOneof('type') == 'iterable_side_input' and
            iterable.transform_id == step.transform_id and
            iterable.side_input_id == side.tag):
          data.append(value)
      impl = self.runtime.coder_impl(
          self.runtime.components.pcollections[side.pcoll].coder_id)
      elements = []
      for chunk in data:
        stream = create_InputStream(chunk)
        while stream.size() > 0:
          elements.append(impl.decode_from_stream(stream, True))
      view = SideInputData.from_runner_api(
          beam_runner_api_pb2.SideInput.FromString(side.payload),
          self.runtime.context)
      values.append(view.view_fn(elements))
    return values

  # -- falling back ---------------------------------------------------------

  def _fall_back(self, fallback: chains.Fallback, replay: _Replay,
                 harness: HarnessFactory, results: list) -> Iterator:
    """SOURCE and UNCLEAN fallbacks (see the module's docstring)."""
    stage = self.stage
    cause = fallback.cause
    why = _why(fallback)
    again = replay.again()
    if not (self._emitted or self._fed) and again is not None:
      _LOGGER.info('%s runs on the SDK harness (%s)', stage.name, why)
      self._whole_on_harness = True
      results.clear()  # (a rest stage's run, fed nothing)
      yield from harness(stage, results.append).run(again)
      return
    if cause is None:
      raise RuntimeError(
          f'{stage.name}: {why} after the fast path had written output; '
          'failing the task so that its retry runs on the SDK harness')
    # The harness should fail too, with its own error.
    _LOGGER.info('%s: the fast path failed (%s); the SDK harness runs the '
                 'partition again to report the error', stage.name, why)
    if again is not None:
      plan, rerun = stage, again
    elif fallback.meta is not None:
      plan, rerun = self._rest_stage(), self._rest(fallback)
    else:
      raise cause
    for _ in harness(plan, results.append).run(rerun):
      pass
    raise RuntimeError(
        f'{stage.name}: the fast path failed ({why}) where the SDK harness '
        'did not; failing the task so that its retry runs on the harness'
    ) from cause

  def _rest_stage(self) -> StagePlan:
    return self.spec.records_stage if self.spec.read_pcoll else self.stage

  def _rest(self, fallback: chains.Fallback) -> Iterator[tuple[str, bytes]]:
    """The input from the element the loop stopped at, as the stage that
    takes over reads it: records of the read, or the stage's elements."""
    spec = self.spec
    if not spec.read_pcoll:
      impl = self.runtime.coder_impl(spec.input_coder_id)
      rest = itertools.chain([fallback.meta], self._elements)
      for chunk in encode_stream(impl, rest):
        yield spec.input_id, chunk
      return
    impl = coders.WindowedValueCoder(
        self.runtime.coder(spec.read_coder_id),
        self.runtime.coder(spec.read_window_coder_id)).get_impl()
    meta, records = self._current

    def records_left():
      yield _as_windowed(meta, fallback.value)
      for value in records:
        yield _as_windowed(meta, value)
      for split in self._elements:
        self._splits += 1
        for value in read_split(split.value):
          yield _as_windowed(split, value)

    for chunk in encode_stream(impl, records_left()):
      yield spec.input_id, chunk


def _why(fallback: chains.Fallback) -> str:
  cause = fallback.cause
  if cause is not None:
    return f'{type(cause).__name__}: {cause}'
  if fallback.kind == chains.SOURCE:
    return 'the source updated a metric or read timestamped values'
  return 'a metric was updated'


def _as_windowed(meta: WindowedValue, value) -> WindowedValue:
  """A record as the reading transform emits it (worker.reads)."""
  if isinstance(value, WindowedValue):
    return value
  if isinstance(value, TimestampedValue):
    return WindowedValue(value.value, value.timestamp, meta.windows)
  return meta.with_value(value)


def _decode(impl, records: Iterable) -> Iterator[WindowedValue]:
  for _, data in records:
    stream = create_InputStream(data)
    decode = impl.decode_from_stream
    while stream.size() > 0:
      yield decode(stream, True)


def choose(stages: Iterable[StagePlan], runtime: JobRuntime
           ) -> tuple[dict[str, FastPath], str]:
  """The stages that take the fast path (name -> chain), and a line for
  the job's messages that counts them. Each stage's reason for taking the
  harness, or for handing it the rest of the stage, is logged at DEBUG."""
  chosen, candidates = {}, 0
  for stage in stages:
    if stage.kind != 'sdk':
      continue
    candidates += 1
    spec = examine(stage, runtime.components)
    while not isinstance(spec, str):
      try:
        chains.load(spec, runtime.context)
        break
      except chains.NotEligibleStep as exn:
        # The loop runs the steps before it; the harness the rest.
        spec = (examine(stage, runtime.components, max_steps=exn.index)
                if exn.index else str(exn))
        if not isinstance(spec, str):
          spec = dataclasses.replace(spec, rest_why=str(exn))
      except Exception as exn:  # pylint: disable=broad-except
        # The job's own modules may be importable only on executors.
        spec = (f'its functions could not be unpickled on the driver '
                f'({type(exn).__name__}: {exn})')
    if isinstance(spec, str):
      _LOGGER.debug('Stage %s runs on the SDK harness: %s', stage.name, spec)
    else:
      _LOGGER.debug(
          'Stage %s runs on the fast path%s', stage.name,
          f' up to {spec.steps[-1].name!r}, the harness after it '
          f'({spec.rest_why})' if spec.rest_stage is not None else '')
      chosen[stage.name] = spec
  return chosen, (f'{len(chosen)} of {candidates} fused stages on the fast '
                  'path (plain loops without the SDK harness; '
                  '--no_fast_path turns it off)')
