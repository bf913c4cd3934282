"""A fused batch stage run as one plain loop, the SDK harness as fallback.

``planning.fastpath`` chose the stage on its protos; here each task loads
its functions (``chain.load``), reads its partition (the bounded source's
splits, or encoded elements) and runs the compiled loop over it. What the
loop writes is what the harness would: elements encoded with the stage's
output coder (the shuffle's records for a GroupByKey with the default
windowing, packed as ``RunStage`` packs the harness's), the precombine's
accumulators (Beam's own, emitted when the table holds too many keys, as
``PGBKCVOperation`` does, and at the end), and Beam's element count per
PCollection.

Whatever the loop cannot keep hands the rest of the partition to the
harness, from the element where it happened: an output that is a
WindowedValue, TimestampedValue or TaggedOutput, a metric update, any
exception from the user's code (the harness then raises Beam's own
"[while running 'X']" error, with the user's traceback). That element's
outputs were held back, so nothing of it was written twice; the loop's
output before it stands. Two cases cannot go on so:

* the source itself updated a metric or read special values: the whole
  partition reruns on the harness, if nothing has left the task yet;
* the combine or an encoder failed while taking an element's outputs in
  part: the harness reruns the partition (its output dropped) to raise
  its own error.

Otherwise the task fails, and Spark's retry of it takes the harness
(``RunStage`` runs the loop in a task's first attempt only).
"""

from __future__ import annotations

import itertools
import logging
import zlib
from typing import Callable
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.coders import coders
from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.coders.coder_impl import create_OutputStream
from apache_beam.metrics import monitoring_infos
from apache_beam.runners.worker import statesampler
from apache_beam.transforms.window import GlobalWindows
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.fastpath import FastPath
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.worker.bundles import TaskResult
from beam_pyspark.worker.elements import CHUNK_BYTES
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.reads import read_split
from beam_pyspark.worker.runtime import JobRuntime

_LOGGER = logging.getLogger(__name__)

# Input kept in memory so that the whole partition can run again on the
# harness: a read's splits always fit; encoded elements up to this much.
REPLAY_BYTES = 64 << 20

_GLOBAL = GlobalWindows.windowed_value(None)

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
  GroupByKey. Yields (output id, chunk) where a chunk is bytes of encoded
  elements (the caller keys them for a shuffle as it keys the harness's)
  or, for compact shuffle records written by the loop itself, an already
  packed (reduce partition, chunk).
  """
  def __init__(self, runtime: JobRuntime, stage: StagePlan, spec: FastPath,
               group: Optional[tuple[int, bool]] = None):
    self.runtime = runtime
    self.stage = stage
    self.spec = spec
    self.group = group

  def run(self, records: Iterable, harness: HarnessFactory,
          on_finish: Callable[[TaskResult], None]) -> Iterator:
    try:
      chain = chains.load(self.spec, self.runtime.context)
    except chains.NotEligible as exn:
      _LOGGER.debug('%s runs on the SDK harness: %s', self.stage.name, exn)
      yield from harness(self.stage, on_finish).run(records)
      return
    output_id = self.spec.output_id
    results: list[TaskResult] = []
    replay = _Replay(records, REPLAY_BYTES)
    self._emitted = False
    self._splits = 0
    self._whole_on_harness = False
    chain.setup()
    watch = _Watch()
    saved = statesampler.get_current_tracker()
    statesampler.set_current_tracker(watch)
    try:
      fallback = None
      try:
        for item in self._loop(chain, watch, replay):
          self._emitted = True
          # The tracker is the loop's only while the loop runs.
          statesampler.set_current_tracker(saved)
          yield output_id, item
          statesampler.set_current_tracker(watch)
      except chains.Fallback as exn:
        fallback = exn
      except Exception as exn:  # pylint: disable=broad-except
        # Reading the input failed (the source, or a decoder).
        fallback = chains.Fallback(chains.UNCLEAN, None, None, exn)
      statesampler.set_current_tracker(saved)
      if fallback is not None and fallback.kind == chains.CLEAN:
        _LOGGER.info('%s continues on the SDK harness (%s)', self.stage.name,
                     _why(fallback))
        try:
          for item in self._flush():
            self._emitted = True
            yield output_id, item
        except chains.Fallback as exn:
          fallback = exn
        else:
          yield from harness(self._rest_stage(), results.append).run(
              self._rest(fallback))
          fallback = None
      if fallback is not None:
        yield from self._fall_back(fallback, replay, harness, results)
    finally:
      statesampler.set_current_tracker(saved)
      chain.teardown()
    infos = [] if self._whole_on_harness else [
        monitoring_infos.int64_counter(
            monitoring_infos.ELEMENT_COUNT_URN, count, pcollection=pcoll)
        for pcoll, count in zip(self.spec.pcollections(), self._counts())]
    for result in results:
      infos.extend(result.monitoring_infos)
    on_finish(
        TaskResult(list(monitoring_infos.consolidate(infos)),
                   sum(r.bundles for r in results)))

  def _counts(self) -> list[int]:
    """Elements the loop committed per PCollection (spec.pcollections())."""
    counts = [self._splits] if self.spec.read_pcoll else []
    counts += self._loop_counts
    if self._table is not None:
      counts.append(self._accumulators[0])
    return counts

  # -- the loop -------------------------------------------------------------

  def _loop(self, chain: chains.Chain, watch: _Watch, replay: _Replay):
    spec = self.spec
    runtime = self.runtime
    read = bool(spec.read_pcoll)
    self._loop_counts = [0] * (len(chain.calls) + 1)
    self._ready = ready = []
    self._table = None
    self._accumulators = [0]
    names = {f'f{i}': fn for i, (fn, _) in enumerate(chain.calls)}
    names.update(plain=_PLAIN, check=_check, watch=watch,
                 counts=self._loop_counts, ready=ready,
                 special_record=_special_record, limit=CHUNK_BYTES,
                 OutputStream=create_OutputStream)
    emit = self._sink(names)
    if chain.combine is not None:
      sink = chains.TABLE
      self._table_sink(chain, emit, names)
    else:
      sink = chains.RECORDS if self._records else chains.ENCODED
    run = chains.compile_loop(
        [single for _, single in chain.calls], sink,
        chain.combine_kind if sink == chains.TABLE else '',
        windowed=not read, read=read, names=names)
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
    yield from self._flush()

  def _sink(self, names: dict) -> Callable:
    """Sets up where outputs go; returns ``emit(key, value)`` for the
    precombine's accumulators."""
    runtime = self.runtime
    coder_id = self.spec.output_coder_id
    ready = self._ready
    compact = self._compact_coders(runtime.coder(coder_id))
    self._records = compact is not None
    if compact is not None:
      encode_key, encode_value = compact
      partitions = self.group[0]
      self._streams = streams = [None] * partitions
      names.update(encode_key=encode_key, encode_value=encode_value,
                   crc32=zlib.crc32, partitions=partitions, streams=streams)

      def emit(key, value):
        kb = encode_key(key)
        vb = encode_value(value)
        p = zlib.crc32(kb) % partitions
        out = streams[p]
        if out is None:
          out = streams[p] = create_OutputStream()
        out.write_var_int64(len(kb))
        out.write(kb)
        out.write_var_int64(len(vb))
        out.write(vb)
        if out.size() >= CHUNK_BYTES:
          ready.append((p, out.get()))
          streams[p] = None

      return emit
    impl = runtime.coder_impl(coder_id)
    encode = impl.encode_to_stream
    self._streams = streams = [create_OutputStream()]
    names.update(encode=encode, streams=streams)

    def emit(key, value):
      out = streams[0]
      encode(_GLOBAL.with_value((key, value)), out, True)
      if out.size() >= CHUNK_BYTES:
        ready.append(out.get())
        streams[0] = create_OutputStream()

    return emit

  def _table_sink(self, chain: chains.Chain, emit: Callable,
                  names: dict) -> None:
    """The precombine's table, emptied as PGBKCVOperation empties it."""
    combine = chain.combine
    self._table = table = {}
    compact = _compact_of(combine)
    accumulators = self._accumulators

    def output(key, acc):
      emit(key, acc if compact is None else compact(acc))
      accumulators[0] += 1

    def evict():
      # PGBKCVOperation.add_key_value: the oldest keys leave, down to 90%.
      target = len(table) * 9 // 10
      old = []
      for key, acc in table.items():
        old.append(key)
        output(key, acc)
        if len(table) - len(old) <= target:
          break
      for key in old:
        del table[key]

    self._output = output
    names.update(
        table=table, max_keys=chain.max_keys, evict=evict,
        create_accumulator=combine.create_accumulator,
        add_input=combine.add_input,
        buffer_size=getattr(combine, '_buffer_size', 0),
        combine_fn=getattr(combine, '_fn', None))

  def _flush(self) -> Iterator:
    """The table's accumulators, then whatever the streams hold."""
    table = self._table
    if table is not None:
      output = self._output
      try:
        for key, acc in table.items():
          output(key, acc)
      except Exception as exn:  # pylint: disable=broad-except
        raise chains.Fallback(chains.UNCLEAN, None, None, exn) from exn
      table.clear()
    yield from self._ready
    self._ready.clear()
    streams = self._streams
    for p, out in enumerate(streams):
      if out is not None and out.size():
        yield (p, out.get()) if self._records else out.get()
    streams[:] = [None] * len(streams)

  def _compact_coders(self, coder):
    """(encode key, encode value) for the shuffle's records of a compact
    group (worker.shuffle.kv_value_records reads the same from the
    encoded element), or None."""
    if self.group is None or not self.group[1]:
      return None
    if type(coder) is not coders.WindowedValueCoder:  # pylint: disable=unidiomatic-typecheck
      return None
    kv = coder.wrapped_value_coder
    if type(kv) is not coders.TupleCoder or len(kv.coders()) != 2:  # pylint: disable=unidiomatic-typecheck
      return None
    key, value = kv.coders()
    if type(key) is coders.LengthPrefixCoder:  # pylint: disable=unidiomatic-typecheck
      encode_key = key.value_coder().get_impl().encode
    elif type(key) is coders.BytesCoder:  # pylint: disable=unidiomatic-typecheck
      encode_key = key.get_impl().encode
    else:
      return None
    if type(value) not in (coders.LengthPrefixCoder, coders.BytesCoder):
      return None
    return encode_key, value.get_impl().encode_nested

  # -- falling back ---------------------------------------------------------

  def _fall_back(self, fallback: chains.Fallback, replay: _Replay,
                 harness: HarnessFactory, results: list) -> Iterator:
    """SOURCE and UNCLEAN fallbacks (see the module's docstring)."""
    stage = self.stage
    cause = fallback.cause
    why = _why(fallback)
    again = replay.again()
    if not self._emitted and again is not None:
      _LOGGER.info('%s runs on the SDK harness (%s)', stage.name, why)
      self._whole_on_harness = True
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


def _compact_of(combine) -> Optional[Callable]:
  """The CombineFn's compact, if it overrides Beam's (PGBKCVOperation)."""
  from apache_beam.transforms import core
  if type(combine).compact is core.CombineFn.compact:
    return None
  return combine.compact


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
  harness is logged at DEBUG."""
  from beam_pyspark.planning.fastpath import examine  # pylint: disable=import-outside-toplevel
  chosen, candidates = {}, 0
  for stage in stages:
    if stage.kind != 'sdk':
      continue
    candidates += 1
    spec = examine(stage, runtime.components)
    if not isinstance(spec, str):
      try:
        chains.load(spec, runtime.context)
      except chains.NotEligible as exn:
        spec = str(exn)
      except Exception as exn:  # pylint: disable=broad-except
        # The job's own modules may be importable only on executors.
        spec = (f'its functions could not be unpickled on the driver '
                f'({type(exn).__name__}: {exn})')
    if isinstance(spec, str):
      _LOGGER.debug('Stage %s runs on the SDK harness: %s', stage.name, spec)
    else:
      _LOGGER.debug('Stage %s runs on the fast path', stage.name)
      chosen[stage.name] = spec
  return chosen, (f'{len(chosen)} of {candidates} fused stages on the fast '
                  'path (plain loops without the SDK harness; '
                  '--no_fast_path turns it off)')
