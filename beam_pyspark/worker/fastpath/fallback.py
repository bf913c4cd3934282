"""Where the fast path's loop hands a partition to the SDK harness.

A CLEAN fallback (nothing of the element reached a sink) ends the loop's
bundle and the harness runs the stage from that element on (for a read,
the stage with the read cut off, fed the split's remaining records).
Where that cannot be (SOURCE: the source did what the loop cannot keep;
UNCLEAN: the combine or an encoder failed halfway through an element's
outputs, a bundle method failed, or a DoFn with bundle methods of its
own was in the middle of a bundle):

* the whole partition runs again on the harness, if nothing has left the
  task yet and its input was kept (``Replay``);
* otherwise a failure reruns the partition on the harness (its output
  dropped) to raise the harness's own error, and anything else fails the
  task, and Spark's retry of it takes the harness (``RunStage`` runs the
  loop in a task's first attempt only).
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.coders import coders
from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.pvalue import SideInputData
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.worker.bundles import TaskResult
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.inputs import Guarded
from beam_pyspark.worker.inputs import InputFailed
from beam_pyspark.worker.reads import read_split

_LOGGER = logging.getLogger(__name__)

# StageRunner(plan, on_finish) -> its run(records) is the harness's output.
HarnessFactory = Callable[[StagePlan, Callable[[TaskResult], None]], object]


class Replay:
  """The task's input records, kept while they fit in ``budget`` bytes.

  A failure of the input (its producer's, ``worker.inputs``) is raised as
  ``InputFailed``, and again by any later read and by ``again``: handed
  over as the loop's own failure, the harness was fed the records kept
  before it and nothing after (the producer's generator had ended), and a
  lost harness upstream became an empty partition in a job that ended
  DONE (issue 39)."""
  def __init__(self, records: Iterable, budget: int):
    self._records = Guarded(records)
    self._budget = budget
    self._size = 0
    self.kept: Optional[list] = []

  @property
  def failed(self) -> Optional[BaseException]:
    return self._records.failed

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
    if self.failed is not None:
      raise InputFailed(self.failed) from self.failed
    if self.kept is None:
      return None
    return itertools.chain(list(self.kept), self._records)


class Handover:
  """One task's fallback, if any (``fast``: its worker.fastpath.FastStage)."""
  def __init__(self, fast, replay: Replay, harness: HarnessFactory,
               results: list):
    self.fast = fast
    self.replay = replay
    self.harness = harness
    self.results = results
    self.emitted = False
    self.fed_any = False
    self.fallback: Optional[chains.Fallback] = None
    self.whole_on_harness = False
    self.failed = False  # the user's code raised: its instances go

  def fed(self, outputs: Iterator) -> Iterator:
    """The loop's output as the rest stage's input. Once it has had some,
    the partition cannot run again whole: the rest stage has run bundles
    (their side effects, a sink's files, are done)."""
    input_id = self.fast.spec.input_id
    for _, chunk in outputs:
      self.fed_any = True
      yield input_id, chunk

  def fell_back(self, fallback: chains.Fallback) -> Iterator:
    """The loop stopped: for a CLEAN fallback its bundle ends here (what
    its tables hold is output) and ``finish`` has the harness do the
    rest."""
    fast = self.fast
    if fallback.kind == chains.CLEAN and fast.instances.bundle_methods:
      fallback.kind = chains.UNCLEAN
    # The user's code raised, or the loop's bundle ends unfinished: its
    # DoFns go (torn down), as Beam discards a failed bundle's processor.
    self.failed = fallback.kind != chains.CLEAN or (
        fallback.cause is not None and
        not isinstance(fallback.cause, chains.SpecialOutput))
    self.fallback = fallback
    if fallback.kind == chains.CLEAN:
      _LOGGER.info('%s continues on the SDK harness (%s)', fast.stage.name,
                   _why(fallback))
      try:
        fast.end_bundle()
        for sink in fast.sinks:
          sink.flush_streams()
        yield from fast.take_ready()
      except chains.Fallback as exn:
        self.fallback = exn
    for sink in getattr(fast, 'sinks', ()):
      sink.streams[:] = []  # what was not sent is dropped

  def finish(self) -> Iterator:
    """What the harness runs after the loop, if anything."""
    fallback = self.fallback
    if fallback is None:
      return
    if fallback.kind == chains.CLEAN:
      yield from self.harness(self._rest_stage(), self.results.append).run(
          self._rest(fallback))
    else:
      yield from self._fall_back(fallback)

  def _fall_back(self, fallback: chains.Fallback) -> Iterator:
    stage = self.fast.stage
    cause = fallback.cause
    why = _why(fallback)
    again = self.replay.again()
    if not (self.emitted or self.fed_any) and again is not None:
      _LOGGER.info('%s runs on the SDK harness (%s)', stage.name, why)
      self.whole_on_harness = True
      self.results.clear()  # (a rest stage's run, fed nothing)
      yield from self.harness(stage, self.results.append).run(again)
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
    for _ in self.harness(plan, self.results.append).run(rerun):
      pass
    raise RuntimeError(
        f'{stage.name}: the fast path failed ({why}) where the SDK harness '
        'did not; failing the task so that its retry runs on the harness'
    ) from cause

  def _rest_stage(self) -> StagePlan:
    fast = self.fast
    return fast.spec.records_stage if fast.spec.read_pcoll else fast.stage

  def _rest(self, fallback: chains.Fallback) -> Iterator[tuple[str, bytes]]:
    """The input from the element the loop stopped at, as the stage that
    takes over reads it: records of the read, or the stage's elements."""
    fast = self.fast
    spec, runtime = fast.spec, fast.runtime
    if spec.grouped:
      # Groups as they came: a large one's values stay in their pages.
      for chunk in fast.input.rest_raw():
        yield spec.input_id, chunk
      return
    if not spec.read_pcoll:
      impl = runtime.coder_impl(spec.input_coder_id)
      rest = itertools.chain([fallback.meta], fast.input.rest())
      for chunk in encode_stream(impl, rest):
        yield spec.input_id, chunk
      return
    impl = coders.WindowedValueCoder(
        runtime.coder(spec.read_coder_id),
        runtime.coder(spec.read_window_coder_id)).get_impl()
    meta, records = fast.current

    def records_left():
      yield _as_windowed(meta, fallback.value)
      for value in records:
        yield _as_windowed(meta, value)
      for split in fast.input.rest():
        fast.splits += 1
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
  if fallback.kind == chains.UNCLEAN:
    return 'a DoFn with bundle methods was mid-bundle'
  return 'code asked for the metrics container itself'


def _as_windowed(meta: WindowedValue, value) -> WindowedValue:
  """A record as the reading transform emits it (worker.reads)."""
  if isinstance(value, WindowedValue):
    return value
  if isinstance(value, TimestampedValue):
    return WindowedValue(value.value, value.timestamp, meta.windows)
  return meta.with_value(value)


def side_values(runtime, spec, calls, side_inputs) -> list[list]:
  """Per call, its side inputs as their views make them, from every
  element the task's state entries hold for them (the global window's)."""
  entries = list(itertools.chain.from_iterable(side_inputs))
  out = []
  for call in calls:
    values = []
    for side in call.side_inputs:
      data = []
      for key, value in entries:
        state_key = beam_fn_api_pb2.StateKey.FromString(key)
        iterable = state_key.iterable_side_input
        if (state_key.WhichOneof('type') == 'iterable_side_input' and
            iterable.transform_id == call.step.transform_id and
            iterable.side_input_id == side.tag):
          data.append(value)
      impl = runtime.coder_impl(
          runtime.components.pcollections[side.pcoll].coder_id)
      elements = []
      for chunk in data:
        stream = create_InputStream(chunk)
        while stream.size() > 0:
          elements.append(impl.decode_from_stream(stream, True))
      view = SideInputData.from_runner_api(
          beam_runner_api_pb2.SideInput.FromString(side.payload),
          runtime.context)
      values.append(view.view_fn(elements))
    out.append(values)
  return out
