"""A fused batch stage run as one plain loop, the SDK harness as fallback.

``planning.fastpath`` chose the stage on its protos; here each task takes
the stage's DoFns and combines, set up once per Python worker
(``chain.Instances``, kept in the harness cache and torn down when the
job ends), reads its partition (the bounded source's splits, or encoded
elements) in bundles cut where the harness cuts them (``bundle_bytes`` of
input), and runs the compiled loop (``codegen``) over each bundle between
the DoFns' ``start_bundle`` and ``finish_bundle``. What the loop writes
is what the harness would (``sinks``): elements encoded with the output
coders, GroupByKeys' shuffle records, precombines' accumulators, Beam's
element count per PCollection and the user's metrics per step
(``metrics``). Side inputs are read whole from the task's state entries
and handed over as the plain values their views make (a dict for
``AsDict``, a list for ``AsList``...).

A stage reading a GroupByKey's output decodes each grouped element as the
harness does, from the chunks the task's grouping wrote: a key with its
values in their windows, timestamp and pane; a large group's values past
the inline part stay in the task's page file and are decoded from it on
every iteration (``worker.shuffle.paging.PagedValues``), never held as a
list. A lifted combine's MergeAccumulators and ExtractOutputs are calls of
its CombineFn in the loop.

A stage whose tree the loop cannot run whole runs its chain up to there
and hands that PCollection's elements to the harness, which runs the
rest of the stage in the same task (``FastPath.rest_stage``).

Whatever the loop cannot keep hands the rest of the partition to the
harness, from the element where it happened: an output that is a
WindowedValue outside the loop's windows, a DoFn taking its window on an
element in several, code asking for the metrics container itself, any
exception from the user's code (the harness then raises Beam's own
"[while running 'X']" error, with the user's traceback). That element's
outputs and metric updates were held back, so nothing of it was written
twice; the loop's output before it stands (``fallback``). Where a DoFn
has bundle methods of its own, the loop's bundle cannot be ended early
that way: the partition runs again on the harness if nothing has left the
task, else the task fails and Spark's retry runs it on the harness.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from typing import Callable
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.coders import coders
from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.metrics import monitoring_infos
from apache_beam.runners.worker import statesampler

from beam_pyspark.planning.fastpath import FastPath
from beam_pyspark.planning.fastpath import examine
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.worker import harnesses
from beam_pyspark.worker.bundles import DEFAULT_BUNDLE_BYTES
from beam_pyspark.worker.bundles import TaskResult
from beam_pyspark.worker.elements import CHUNK_BYTES
from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.fastpath import codegen
from beam_pyspark.worker.fastpath import sinks
from beam_pyspark.worker.fastpath.fallback import HarnessFactory
from beam_pyspark.worker.fastpath.fallback import Replay
from beam_pyspark.worker.fastpath.fallback import Handover
from beam_pyspark.worker.fastpath.fallback import side_values
from beam_pyspark.worker.fastpath.metrics import StepMetrics
from beam_pyspark.worker.fastpath.metrics import Tracker
from beam_pyspark.worker.inputs import InputFailed
from beam_pyspark.worker.reads import read_split
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.sequence import Offsets

_LOGGER = logging.getLogger(__name__)

# Input kept in memory so that the whole partition can run again on the
# harness: a read's splits always fit; encoded elements up to this much.
REPLAY_BYTES = 64 << 20

# Whether stages reading a GroupByKey's output take the fast path too
# (BEAM_PYSPARK_FAST_REDUCE=0 on the driver leaves them to the harness).
REDUCE_SIDE = os.environ.get('BEAM_PYSPARK_FAST_REDUCE', '1') != '0'

# Types checked once: not a WindowedValue, TimestampedValue or TaggedOutput.
_PLAIN: set = {str, bytes, int, float, bool, tuple, list, dict, type(None)}


def _special_record(x) -> bool:
  if chains.is_special(x):
    return True
  _PLAIN.add(type(x))
  return False


class _Input:
  """The task's elements in bundles, cut where StageRunner cuts them:
  after the record whose bytes bring the bundle to ``bundle_bytes``.
  ``raw``: where each element starts is kept (``at``), so that the rest
  of the input can be handed over as the bytes it came in (a group's
  paged values stay pages)."""
  def __init__(self, records: Iterable, impl, bundle_bytes: int,
               raw: bool = False):
    self._records = iter(records)
    self._impl = impl
    self._bytes = bundle_bytes
    self._size = 0
    self._pending: Iterator = iter(())
    self._raw = raw
    self.at: tuple = (b'', 0)

  def _decode(self, data: bytes) -> Iterator:
    if type(data) is Offsets:  # pylint: disable=unidiomatic-typecheck
      if not self._raw:  # a sequence read's chunk: its elements as they are
        yield from data.elements()
        return
      data = data.encode(self._impl)
    stream = create_InputStream(data)
    decode = self._impl.decode_from_stream
    if self._raw:
      total = len(data)
      while stream.size() > 0:
        self.at = (data, total - stream.size())
        yield decode(stream, True)
      return
    while stream.size() > 0:
      yield decode(stream, True)

  def next_bundle(self) -> bool:
    record = next(self._records, None)
    if record is None:
      return False
    self._size = len(record[1])
    self._pending = self._decode(record[1])
    return True

  def elements(self) -> Iterator:
    """The current bundle's elements (not ``yield from``: a loop that
    stops early must not close the record it was reading)."""
    while True:
      for element in self._pending:
        yield element
      if self._size >= self._bytes:
        return
      record = next(self._records, None)
      if record is None:
        return
      self._size += len(record[1])
      self._pending = self._decode(record[1])

  def rest_raw(self) -> Iterator[bytes]:
    """``raw``: the bytes from the last element read on."""
    data, start = self.at
    if start < len(data):
      yield data[start:] if start else data
    for _, data in self._records:
      yield data

  def rest(self) -> Iterator:
    """Every element not yet read."""
    return itertools.chain(
        self._pending, itertools.chain.from_iterable(
            self._decode(data) for _, data in self._records))


class FastStage:
  """One task's run of a fast-path stage (see the module's docstring).

  ``groups``: output id -> (reduce partitions, compact) for outputs that
  feed a GroupByKey. ``side_inputs``: the task's side input state entries
  (a list per side input, as StageRunner takes them).
  Yields (output id, chunk) where a chunk is bytes of encoded elements
  (the caller keys them for a shuffle as it keys the harness's) or, for
  compact shuffle records written by the loop itself, an already packed
  (reduce partition, chunk).
  """
  def __init__(self, runtime: JobRuntime, stage: StagePlan, spec: FastPath,
               groups: Optional[dict] = None, side_inputs: Iterable = (),
               bundle_bytes: int = DEFAULT_BUNDLE_BYTES):
    self.runtime = runtime
    self.stage = stage
    self.spec = spec
    self.groups = groups or {}
    self.side_inputs = side_inputs
    self.bundle_bytes = bundle_bytes
    self.instances: Optional[chains.Instances] = None
    self.handover: Optional[Handover] = None

  def run(self, records: Iterable, harness: HarnessFactory,
          on_finish: Callable[[TaskResult], None]) -> Iterator:
    spec, stage = self.spec, self.stage
    name = f'fastpath/{stage.name}'
    try:
      instances = harnesses.keep(
          self.runtime.job_id, name,
          lambda: chains.Instances(chains.load(spec, self.runtime)))
    except chains.NotEligible as exn:
      _LOGGER.debug('%s runs on the SDK harness: %s', stage.name, exn)
      yield from harness(stage, on_finish).run(records)
      return
    self.instances = instances
    instances.claim()
    results: list[TaskResult] = []
    replay = Replay(records, REPLAY_BYTES)
    self.handover = handover = Handover(self, replay, harness, results)
    ok = False
    try:
      if spec.rest_stage is not None:
        # The harness runs the rest of the stage on the loop's output.
        outputs = harness(spec.rest_stage, results.append).run(
            handover.fed(self._guarded(replay)))
      else:
        outputs = self._guarded(replay)
      for item in outputs:
        handover.emitted = True
        yield item
      yield from handover.finish()
      ok = True
    finally:
      instances.release()
      if not ok or handover.failed or instances.uncached:
        # Beam discards a bundle processor whose bundle failed.
        harnesses.forget(self.runtime.job_id, name, instances)
    infos = [] if handover.whole_on_harness else self._infos()
    for result in results:
      infos.extend(result.monitoring_infos)
    on_finish(
        TaskResult(list(monitoring_infos.consolidate(infos)),
                   sum(r.bundles for r in results)))

  def _infos(self) -> list:
    if self.spec.read_pcoll:
      self._counts[0] = self.splits
    for table, at in self.tables:
      self._counts[at] = table.accumulators
    infos = self._metrics.monitoring_infos()
    skip = {self.spec.boundary_pcoll}
    for pcoll, count in zip(self._pcolls, self._counts):
      if pcoll not in skip:
        infos.append(monitoring_infos.int64_counter(
            monitoring_infos.ELEMENT_COUNT_URN, count, pcollection=pcoll))
    return infos

  # -- the loop -------------------------------------------------------------

  def _prepare(self) -> None:
    """The task's sinks, counts, metrics and compiled loop."""
    spec, runtime, instances = self.spec, self.runtime, self.instances
    calls = instances.calls
    self.ready: list = []
    self.splits = 0
    self._pcolls = spec.pcollections()
    self._counts = [0] * len(self._pcolls)
    index = {p: i for i, p in enumerate(self._pcolls)}
    self._metrics = StepMetrics([c.step.transform_id for c in calls])
    self.tracker = Tracker()
    tree_sinks: dict = {}
    number = itertools.count()
    self.sinks = []
    for output in spec.outputs:
      coder = runtime.coder(output.coder_id)
      if output.window_coder_id:
        coder = coders.WindowedValueCoder(
            coder, runtime.coder(output.window_coder_id))
      self.sinks.append(sinks.output_sink(
          next(number), output.transform_id, coder,
          self.groups.get(output.transform_id), self.ready, CHUNK_BYTES))
      tree_sinks.setdefault(output.pcoll, []).append(self.sinks[-1])
    self.tables = []
    counted = dict(index)
    for call in calls:
      if call.kind != chains.COMBINE:
        continue
      out = call.step.output_pcoll
      (target, ) = tree_sinks.pop(out)
      table = sinks.Table(next(number), call, target)
      self.tables.append((table, index[out]))
      tree_sinks[call.step.transform_id] = [table]
      counted.pop(out)
    for call in calls:
      for _, pcoll in call.step.outputs:
        if pcoll not in tree_sinks and not any(
            pcoll in c.step.inputs for c in calls):
          tree_sinks[pcoll] = [sinks.discard(next(number))]
    counted.pop(spec.input_pcoll if spec.read_pcoll else '', None)
    counted.pop(spec.boundary_pcoll, None)
    self.sinks += [t for t, _ in self.tables]
    meta = spec.windowed or any(
        s.kind == sinks.ENCODED for ss in tree_sinks.values() for s in ss
        ) or any(
            c.params or c.kind == chains.ASSIGN for c in calls)
    self.tree = codegen.Tree(
        calls=calls, root=spec.read_pcoll or spec.input_pcoll,
        sinks=tree_sinks, counts=counted, meta=meta,
        metered=instances.metered, checks=instances.checks)
    self.names = {
        'plain': _PLAIN, 'ready': self.ready, 'counts': self._counts,
        'special_record': _special_record,
        'chk': instances.checks}
    for i, call in enumerate(calls):
      self.names[f's{i}'] = self._metrics.containers[call.step.transform_id]
    for sink in self.sinks:
      self.names.update(sink.names)
    for table, _ in self.tables:
      self.names[f'ts{table.index}'] = self._metrics.containers[
          table.transform_id]
    values = side_values(self.runtime, spec, calls, self.side_inputs)
    self.bound = [c.bind(values[i]) for i, c in enumerate(calls)]
    self._compile()

  def _compile(self) -> None:
    self.loop = codegen.compile_loop(
        self.tree, self.names, self.bound, bool(self.spec.read_pcoll),
        self.tracker)
    self.feeds = codegen.feed_functions(
        self.tree, self.names, self.bound, self.tracker)

  def _guarded(self, replay: Replay) -> Iterator:
    """The loop's output; where it falls back, the handover is told. The
    thread's metrics tracker is the loop's only while the loop runs."""
    saved = statesampler.get_current_tracker()
    tracker = None
    try:
      self._prepare()
      tracker = self.tracker
      loop = self._bundles(replay)
      while True:
        statesampler.set_current_tracker(tracker)
        try:
          item = next(loop)
        except StopIteration:
          return
        finally:
          statesampler.set_current_tracker(saved)
        yield item
    except chains.Fallback as exn:
      fallback = exn
    except InputFailed:
      # The stage feeding this one failed: no fallback reads on after it
      # (worker.inputs), the task fails with its error.
      raise
    except Exception as exn:  # pylint: disable=broad-except
      # Decoding the input failed, or a side input's view.
      fallback = chains.Fallback(chains.UNCLEAN, None, None, exn)
    if tracker is not None:
      tracker.drop()
    yield from self.handover.fell_back(fallback)

  def _bundles(self, replay: Replay) -> Iterator:
    spec, runtime, instances = self.spec, self.runtime, self.instances
    self.input = source = _Input(
        replay, runtime.coder_impl(spec.input_coder_id), self.bundle_bytes,
        raw=spec.grouped)
    read = bool(spec.read_pcoll)
    while source.next_bundle():
      # Set up with the first bundle (an empty partition, as a reduce
      # partition no key went to, sets up nothing, as on the harness).
      try:
        instances.setup(lambda call: self._metrics.scope(self.tracker, None))
      except Exception as exn:  # pylint: disable=broad-except
        raise chains.Fallback(chains.UNCLEAN, None, None, exn) from exn
      self._start_bundle()
      if read:
        for meta in source.elements():
          self.splits += 1
          records = read_split(meta.value)
          self.current = (meta, records)
          yield from self._units(records, meta)
      else:
        yield from self._units(source.elements(), None)
      self.end_bundle()
      yield from self.take_ready()
    for sink in self.sinks:
      sink.flush_streams()
    yield from self.take_ready()

  def _units(self, units, meta) -> Iterator:
    while True:
      learned = yield from self.loop(units, meta)
      if learned != 'learned':
        return
      # A metric update: from now on the loop says which step runs.
      self.instances.metered = self.tree.metered = True
      self._compile()

  def _start_bundle(self) -> None:
    for call in self.instances.starts:
      try:
        with self._metrics.scope(self.tracker, call.step.transform_id):
          result = call.dofn.start_bundle()
        if result is not None:
          raise RuntimeError('Start Bundle should not output any elements '
                             f'but got {result}')
      except Exception as exn:  # pylint: disable=broad-except
        raise chains.Fallback(chains.UNCLEAN, None, None, exn) from exn

  def end_bundle(self) -> None:
    """The bundle's end: each DoFn's finish_bundle (its outputs sent down
    the tree), then the tables emptied (an UNCLEAN Fallback if one
    fails)."""
    calls = self.instances.calls
    for call in self.instances.finishes:
      i = calls.index(call)
      try:
        with self._metrics.scope(self.tracker, call.step.transform_id):
          results = call.dofn.finish_bundle()
        if results is not None:
          self.feeds[i](results)
          self.tracker.settle()
      except Exception as exn:  # pylint: disable=broad-except
        raise chains.Fallback(chains.UNCLEAN, None, None, exn) from exn
    for table, _ in self.tables:
      table.flush_table()

  def take_ready(self) -> Iterator:
    ready = self.ready
    if ready:
      items = list(ready)
      ready.clear()
      yield from items


def choose(stages: Iterable[StagePlan], runtime: JobRuntime
           ) -> tuple[dict[str, FastPath], str]:
  """The stages that take the fast path (name -> tree), and a line for
  the job's messages that counts them. Each stage's reason for taking the
  harness, or for handing it the rest of the stage, is logged at DEBUG."""
  chosen, candidates = {}, 0
  for stage in stages:
    if stage.kind != 'sdk':
      continue
    candidates += 1
    spec = examine(stage, runtime.components, reduce_side=REDUCE_SIDE)
    while not isinstance(spec, str):
      try:
        chains.load(spec, runtime)
        break
      except chains.NotEligibleStep as exn:
        # The loop runs the steps before it; the harness the rest.
        spec = (examine(stage, runtime.components, max_steps=exn.index,
                        reduce_side=REDUCE_SIDE)
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
  names = '; '.join(_short(spec) for spec in chosen.values())
  if len(names) > NAMES_CHARS:
    names = names[:NAMES_CHARS - 3] + '...'
  return chosen, (f'{len(chosen)} of {candidates} fused stages on the fast '
                  'path (plain loops without the SDK harness; '
                  f'--no_fast_path turns it off){": " if names else ""}'
                  f'{names}')


# How much of the job's message names the stages on the fast path.
NAMES_CHARS = 400


def _short(spec: FastPath) -> str:
  """A stage on the fast path as the user named its transforms: the
  first name of each composite, in order ('Split+PairWithOne+Count'), or
  a composite's own step ('Write/FinalizeWrite')."""
  names = []
  for step in spec.steps:
    name = step.name.split('/')[0]
    if name not in names:
      names.append(name)
  if len(names) == 1 and '/' in spec.steps[-1].name:
    # Steps of one composite (WriteToText's): which of them.
    return f'{names[0]}/{spec.steps[-1].name.rsplit("/", 1)[1]}'
  return '+'.join(names) or 'Flatten'
