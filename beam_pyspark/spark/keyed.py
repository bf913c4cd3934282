"""The driver's view of a streaming job's keyed partitions.

Keyed nodes (a GroupByKey's reduce side, a stateful stage) keep state per
partition between waves; their tasks report (``worker.streaming``) the
partition's new chain of state files, its earliest output hold and when
its next event- and processing-time timers are due. ``KeyedPartitions``
keeps those reports: which chain each task reads next, which nodes have
timers due at given clocks, and what a checkpoint commits of them.
"""

from __future__ import annotations

import collections
from typing import Callable
from typing import Iterable
from typing import Optional


class KeyedPartitions:
  def __init__(self):
    # node -> partition -> its state's chain of files.
    self.states: dict[str, dict[int, tuple]] = collections.defaultdict(dict)
    self.next_event: dict[str, dict[int, int]] = collections.defaultdict(dict)
    self.next_processing: dict[str, dict[int, int]] = (
        collections.defaultdict(dict))

  def chains(self, node: str) -> dict:
    """Each partition's state chain (a few names: tasks read the files)."""
    return dict(self.states.get(node) or {})

  def report(self, node: str, report,
             changed: Callable[[str, int, Optional[tuple], Optional[tuple]],
                               None]) -> Optional[int]:
    """A task's PartitionReport; ``changed(node, partition, before,
    after)`` hears of a new chain. Returns the partition's hold."""
    p = report.partition
    before = self.states[node].get(p)
    if report.state != before:
      changed(node, p, before, report.state)
    _set(self.states[node], p, report.state)
    _set(self.next_event[node], p, report.next_event)
    _set(self.next_processing[node], p, report.next_processing)
    return report.hold

  def nodes_with_timers(self) -> Iterable[str]:
    return self.next_event.keys() | self.next_processing.keys()

  def due(self, node: str, input_watermark: int, now: int) -> bool:
    """Whether a node has timers due at its input watermark or ``now``."""
    event = min(self.next_event[node].values(), default=None)
    processing = min(self.next_processing[node].values(), default=None)
    return ((event is not None and event <= input_watermark) or
            (processing is not None and processing <= now))

  def next_processing_time(self) -> Optional[int]:
    return min((t for table in self.next_processing.values()
                for t in table.values()), default=None)

  def snapshot(self) -> dict:
    return {
        'next_event': {n: dict(t) for n, t in self.next_event.items() if t},
        'next_processing': {
            n: dict(t) for n, t in self.next_processing.items() if t},
    }

  def restore(self, driver: dict, states: dict) -> None:
    for table, saved in ((self.next_event, driver['next_event']),
                         (self.next_processing, driver['next_processing'])):
      for node, by_partition in saved.items():
        table[node].update(by_partition)
    for node, chains in states.items():
      self.states[node].update(chains)


def _set(table: dict, partition: int, value) -> None:
  if value is None:
    table.pop(partition, None)
  else:
    table[partition] = value
