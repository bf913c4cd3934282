"""Merging MonitoringInfos from many tasks into a job's metrics.

Beam's ``monitoring_infos.consolidate`` merges only sums and distributions;
gauges (latest wins), string sets (union) and bounded tries (trie merge) are
merged here too.  Tasks report per (stage, partition); a partition whose task
ran twice reports twice, so "attempted" sums every report while
"committed" keeps one report per (stage, partition).
"""

from __future__ import annotations

import collections
import logging
from typing import Iterable

from apache_beam.coders import coders
from apache_beam.metrics import monitoring_infos as mi
from apache_beam.metrics.cells import BoundedTrieData
from apache_beam.portability.api import metrics_pb2
from apache_beam.runners.portability.fn_api_runner.fn_runner import FnApiMetrics

_STRING_SET_CODER = coders.IterableCoder(coders.StrUtf8Coder())
_LOGGER = logging.getLogger(__name__)
_warned: set = set()


def _well_formed(info: metrics_pb2.MonitoringInfo) -> bool:
  """Whether a distribution's payload is the model's four varints (count,
  sum, min, max) and nothing more. Beam's TypeScript SDK 2.49 encodes it
  otherwise; read as the model says, it would be nonsense: dropped, once
  with a warning naming the metric."""
  if not mi.is_distribution(info):
    return True
  from apache_beam.coders.coder_impl import create_InputStream  # pylint: disable=import-outside-toplevel
  stream = create_InputStream(info.payload)
  try:
    for _ in range(4):
      stream.read_var_int64()
    ok = stream.size() == 0
  except Exception:  # pylint: disable=broad-except
    ok = False
  if not ok and (info.urn, tuple(sorted(info.labels.items()))) not in _warned:
    _warned.add((info.urn, tuple(sorted(info.labels.items()))))
    _LOGGER.warning(
        'Dropping distribution %s %s: its payload (%d bytes) is not the '
        'model\'s four varints (count, sum, min, max); the SDK that sent it '
        'encodes distributions otherwise.', info.urn, dict(info.labels),
        len(info.payload))
  return ok


def _merge_pair(a: metrics_pb2.MonitoringInfo, b: metrics_pb2.MonitoringInfo):
  if mi.is_gauge(a):
    ta, _ = mi.extract_gauge_value(a)
    tb, _ = mi.extract_gauge_value(b)
    return a if ta >= tb else b
  if mi.is_string_set(a):
    values = mi.extract_string_set_value(a) | mi.extract_string_set_value(b)
    return metrics_pb2.MonitoringInfo(
        urn=a.urn,
        type=a.type,
        labels=a.labels,
        payload=_STRING_SET_CODER.encode(sorted(values)))
  if mi.is_bounded_trie(a):
    merged = mi.extract_bounded_trie_value(a).combine(
        mi.extract_bounded_trie_value(b))
    return metrics_pb2.MonitoringInfo(
        urn=a.urn,
        type=a.type,
        labels=a.labels,
        payload=merged.to_proto().SerializeToString())
  return None


def merge_monitoring_infos(
    infos: Iterable[metrics_pb2.MonitoringInfo]) -> list[metrics_pb2.MonitoringInfo]:
  grouped = collections.defaultdict(list)
  for info in infos:
    if _well_formed(info):
      grouped[mi.to_key(info)].append(info)
  result = []
  for values in grouped.values():
    if len(values) == 1:
      result.append(values[0])
      continue
    first = values[0]
    if mi.is_gauge(first) or mi.is_string_set(first) or mi.is_bounded_trie(first):
      merged = first
      for other in values[1:]:
        merged = _merge_pair(merged, other)
      result.append(merged)
    else:
      result.extend(mi.consolidate(values))
  return result


class TaskMetrics:
  """Reports of every task of a job, as (stage, partition, infos).

  ``compacted()`` folds them into two reports (a streaming job keeps its
  metrics so, between micro-batches and in its checkpoints): one counted
  as committed only, one as attempted only.
  """
  COMMITTED_ONLY = '@committed'
  ATTEMPTED_ONLY = '@attempted'

  def __init__(self):
    self._reports: list[tuple[str, int, list[bytes]]] = []

  def add(self, reports: Iterable[tuple[str, int, list[bytes]]]) -> None:
    self._reports.extend(reports)

  def attempted(self) -> list[metrics_pb2.MonitoringInfo]:
    return merge_monitoring_infos(
        metrics_pb2.MonitoringInfo.FromString(b)
        for stage, _, infos in self._reports
        if stage != self.COMMITTED_ONLY for b in infos)

  def committed(self) -> list[metrics_pb2.MonitoringInfo]:
    last = {}
    for stage, partition, infos in self._reports:
      if stage != self.ATTEMPTED_ONLY:
        last[(stage, partition)] = infos
    return merge_monitoring_infos(
        metrics_pb2.MonitoringInfo.FromString(b)
        for infos in last.values() for b in infos)

  def tasks_done(self) -> dict[str, int]:
    """Per fused stage, how many of its partitions' tasks reported (a
    task reports when it ends); a streaming wave's '@serial' left off."""
    partitions: dict[str, set] = collections.defaultdict(set)
    for stage, partition, _ in self._reports:
      if stage not in (self.COMMITTED_ONLY, self.ATTEMPTED_ONLY):
        partitions[stage.split('@', 1)[0]].add(partition)
    return {stage: len(done) for stage, done in partitions.items()}

  def compacted(self) -> list[tuple[str, int, list[bytes]]]:
    def serialized(infos):
      return [m.SerializeToString() for m in infos]
    return [(self.COMMITTED_ONLY, 0, serialized(self.committed())),
            (self.ATTEMPTED_ONLY, 0, serialized(self.attempted()))]


class PipelineMetrics(FnApiMetrics):
  """``result.metrics()``: the user's metrics, merged over all tasks."""
  def __init__(self, committed, attempted=None, user_metrics_only=True):
    super().__init__({'': list(committed)}, user_metrics_only=user_metrics_only)
    self._attempted = FnApiMetrics(
        {'': list(attempted if attempted is not None else committed)},
        user_metrics_only=user_metrics_only)

  def query(self, filter=None):
    committed = super().query(filter)
    attempted = self._attempted.query(filter)
    # FnApiMetrics reports committed == attempted; pair ours up by key.
    for kind, results in committed.items():
      by_key = {r.key: r.committed for r in attempted.get(kind, [])}
      for r in results:
        r.attempted = by_key.get(r.key, r.attempted)
    return committed
