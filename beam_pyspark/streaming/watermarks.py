"""Per-stage watermarks with holds: a state machine fed with events.

Each stage (a fused stage, a GroupByKey's reduce side, a source) has two
watermarks that only move forward (Prism's ``ElementManager``, from which
the rules are taken):

    input  = max(input,  min(earliest pending element, upstream outputs))
    output = max(output, min(input, earliest hold))

A stage's upstream outputs are the output watermarks of the stages that
produce its main inputs *and* its side inputs. Pending elements are what
was handed to the stage but not yet processed (their timestamps are
tracked as a multiset); holds are what the stage keeps back on purpose:
a timer's output timestamp, the earliest element of a window a trigger has
not fired, main input parked until its side input's window is ready.

A source stage has no upstream: its input watermark is what its reader
reports (``set_source``), ``MAX_MICROS`` once it is exhausted.

``refresh()`` propagates in topological order until nothing moves and
returns the stages whose input watermark advanced: those may now have
timers or windows to fire. ``done`` is true once every output watermark is
at ``MAX_MICROS``.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Iterable
from typing import Optional

from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming import MIN_MICROS


class WatermarkError(ValueError):
  """The stage graph is malformed (unknown stage, cycle, two producers)."""


@dataclasses.dataclass
class _Stage:
  stage_id: str
  inputs: tuple[str, ...]
  side_inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  is_source: bool
  input_wm: int = MIN_MICROS
  output_wm: int = MIN_MICROS
  source_wm: int = MIN_MICROS
  # Pending element timestamps: a counted multiset with a lazy min-heap.
  pending: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  pending_heap: list = dataclasses.field(default_factory=list)
  holds: dict = dataclasses.field(default_factory=dict)

  def min_pending(self) -> Optional[int]:
    heap = self.pending_heap
    while heap and self.pending[heap[0]] <= 0:
      del self.pending[heapq.heappop(heap)]
    return heap[0] if heap else None

  def min_hold(self) -> int:
    return min(self.holds.values(), default=MAX_MICROS)


class WatermarkGraph:
  """The watermarks of a job's stages."""
  def __init__(self):
    self._stages: dict[str, _Stage] = {}
    self._producer: dict[str, str] = {}  # pcollection -> stage
    self._order: Optional[list[str]] = None

  # -- the graph ------------------------------------------------------------

  def add_stage(self, stage_id: str, inputs: Iterable[str] = (),
                outputs: Iterable[str] = (),
                side_inputs: Iterable[str] = (),
                source: bool = False) -> None:
    """A stage reading ``inputs`` (and ``side_inputs``), writing ``outputs``.

    A stage with no inputs is a source whether or not ``source`` says so.
    """
    if stage_id in self._stages:
      raise WatermarkError(f'stage {stage_id!r} was added twice')
    inputs, outputs = tuple(inputs), tuple(outputs)
    stage = _Stage(stage_id, inputs, tuple(side_inputs), outputs,
                   source or not inputs)
    for pcoll in outputs:
      if pcoll in self._producer:
        raise WatermarkError(
            f'PCollection {pcoll!r} is produced by both '
            f'{self._producer[pcoll]!r} and {stage_id!r}')
      self._producer[pcoll] = stage_id
    self._stages[stage_id] = stage
    self._order = None

  def _topological(self) -> list[str]:
    if self._order is not None:
      return self._order
    upstream = {
        sid: {self._producer[p] for p in s.inputs + s.side_inputs
              if p in self._producer}
        for sid, s in self._stages.items()
    }
    order, marks = [], {}

    def visit(sid, path):
      mark = marks.get(sid)
      if mark == 'done':
        return
      if mark == 'active':
        raise WatermarkError(f'stages form a cycle: {" -> ".join(path)}')
      marks[sid] = 'active'
      for up in sorted(upstream[sid]):
        visit(up, path + [up])
      marks[sid] = 'done'
      order.append(sid)

    for sid in sorted(self._stages):
      visit(sid, [sid])
    self._order = order
    return order

  def _stage(self, stage_id: str) -> _Stage:
    try:
      return self._stages[stage_id]
    except KeyError:
      raise WatermarkError(f'unknown stage {stage_id!r}') from None

  # -- events ---------------------------------------------------------------

  def set_source(self, stage_id: str, watermark: int) -> None:
    """A source's reader reports its watermark (never moves back)."""
    stage = self._stage(stage_id)
    if not stage.is_source:
      raise WatermarkError(f'stage {stage_id!r} is not a source')
    stage.source_wm = max(stage.source_wm, watermark)

  def add_pending(self, stage_id: str, timestamps: Iterable[int]) -> None:
    """Elements handed to the stage, not yet processed."""
    stage = self._stage(stage_id)
    for ts in timestamps:
      if stage.pending[ts] <= 0:
        heapq.heappush(stage.pending_heap, ts)
      stage.pending[ts] += 1

  def remove_pending(self, stage_id: str, timestamps: Iterable[int]) -> None:
    """Elements the stage has processed (their outputs already added)."""
    stage = self._stage(stage_id)
    for ts in timestamps:
      if stage.pending[ts] <= 0:
        raise WatermarkError(
            f'stage {stage_id!r} had no pending element at {ts}')
      stage.pending[ts] -= 1

  def set_hold(self, stage_id: str, name, timestamp: Optional[int]) -> None:
    """Holds the stage's output watermark at ``timestamp`` (None: release).

    A hold behind the stage's output watermark cannot pull it back; it
    keeps it where it is.
    """
    stage = self._stage(stage_id)
    if timestamp is None or timestamp >= MAX_MICROS:
      stage.holds.pop(name, None)
    else:
      stage.holds[name] = timestamp

  # -- propagation ----------------------------------------------------------

  def refresh(self) -> set[str]:
    """Applies the rules over the graph; the stages whose input advanced."""
    advanced = set()
    for sid in self._topological():
      stage = self._stages[sid]
      if stage.is_source and not stage.inputs:
        upstream = stage.source_wm
      else:
        upstream = MAX_MICROS
        for pcoll in stage.inputs + stage.side_inputs:
          producer = self._producer.get(pcoll)
          if producer is not None:
            upstream = min(upstream, self._stages[producer].output_wm)
        if stage.is_source:
          upstream = min(upstream, stage.source_wm)
      pending = stage.min_pending()
      if pending is not None:
        upstream = min(upstream, pending)
      new_input = max(stage.input_wm, upstream)
      if new_input > stage.input_wm:
        stage.input_wm = new_input
        advanced.add(sid)
      stage.output_wm = max(stage.output_wm,
                            min(stage.input_wm, stage.min_hold()))
    return advanced

  # -- reading --------------------------------------------------------------

  def input_watermark(self, stage_id: str) -> int:
    return self._stage(stage_id).input_wm

  def output_watermark(self, stage_id: str) -> int:
    return self._stage(stage_id).output_wm

  def pcollection_watermark(self, pcoll: str) -> int:
    producer = self._producer.get(pcoll)
    if producer is None:
      raise WatermarkError(f'no stage produces {pcoll!r}')
    return self._stages[producer].output_wm

  def has_pending(self, stage_id: str) -> bool:
    return self._stage(stage_id).min_pending() is not None

  @property
  def done(self) -> bool:
    return all(s.output_wm >= MAX_MICROS for s in self._stages.values())

  def snapshot(self) -> dict:
    """The graph's watermarks as plain data (for a manifest, a status page)."""
    return {
        sid: {'input': s.input_wm, 'output': s.output_wm,
              'source': s.source_wm, 'holds': dict(s.holds)}
        for sid, s in self._stages.items()
    }

  def restore(self, snapshot: dict) -> None:
    """Watermarks and holds from ``snapshot()`` (pending elements are not
    part of it: a restarted batch adds them again)."""
    for sid, values in snapshot.items():
      stage = self._stage(sid)
      stage.input_wm = values['input']
      stage.output_wm = values['output']
      stage.source_wm = values['source']
      stage.holds = dict(values['holds'])
