"""A streaming wave's control records, to the driver beside its data.

The tasks of a keyed node (a GroupByKey's reduce side, a stateful or
splittable stage: spark.streaming) end with records for the driver, not
for their consumers: a PartitionReport (worker.streaming), main input held
back, residual restrictions. Each task hands them to an accumulator while
it passes its data on, so its consumers run in the same Python pass over
the partition: no persisted copy and no second pass to take the controls
out (each Python pass over a partition costs a round trip to a Python
worker, ~50 ms on a busy machine; the wave of a windowed count ran 8
passes in its last Spark stage, 2 do now).

Spark merges a task's accumulator updates when the task succeeds (a failed
attempt's are dropped). A partition computed twice in a wave (a cached
block lost and recomputed) reports twice: the driver keeps its last.
"""

from __future__ import annotations

import collections

from beam_pyspark.spark.tasks import ListAccumulator
from beam_pyspark.worker.streaming import is_control


class Controls:
  """mapPartitionsWithIndex over a keyed node's output: its data on, its
  control records as one accumulator update per partition."""
  def __init__(self, accumulator, slot: int):
    self.accumulator = accumulator
    self.slot = slot

  def __call__(self, index: int, records):
    control = []
    for record in records:
      if is_control(record):
        control.append(record)
      else:
        yield record
    self.accumulator.add([(self.slot, index, control)])


class WaveControls:
  """The driver's side: a wave's keyed outputs and what their tasks sent."""
  def __init__(self, sc):
    self.accumulator = sc.accumulator([], ListAccumulator())
    self._outputs: list = []  # slot -> (node, its output)

  def start(self) -> None:
    self._outputs = []
    self.accumulator.value = []

  def wrap(self, node: str, out):
    """``out`` without its control records, which reach the driver."""
    slot = len(self._outputs)
    data = out.mapPartitionsWithIndex(
        Controls(self.accumulator, slot), preservesPartitioning=True)
    self._outputs.append((node, data))
    return data

  def unrun(self) -> list:
    """The outputs none of whose partitions ran in the wave's jobs (every
    partition that runs sends an update, if only an empty one)."""
    ran = {slot for slot, _, _ in self.accumulator.value}
    return [out for slot, (_, out) in enumerate(self._outputs)
            if slot not in ran]

  def take(self) -> list[tuple[str, list]]:
    """(node, its control records) for each node wrapped in the wave, in
    the order they were, each node's records in partition order."""
    last = {(slot, index): control
            for slot, index, control in self.accumulator.value}
    by_node = collections.defaultdict(list)
    for (slot, _), control in sorted(last.items(), key=lambda kv: kv[0]):
      by_node[self._outputs[slot][0]].extend(control)
    nodes = dict.fromkeys(node for node, _ in self._outputs)
    self.start()
    return [(node, by_node.get(node, [])) for node in nodes]
