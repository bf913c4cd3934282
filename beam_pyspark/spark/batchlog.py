"""What each micro-batch of a streaming job did: its job message, the
runner's streaming metrics (result.metrics(), /metrics), and the points
the status page charts (streaming.series), with the job's status.

Records read are the elements out of the job's reads (the outputs of its
splittable DoFns' processing and of its TestStreams); records emitted are
the elements into the pipeline's last transforms (those whose output no
transform reads): both from Beam's element counts as committed with each
micro-batch, so a micro-batch run again after a crash counts once.
"""

from __future__ import annotations

import time
from typing import Iterable
from typing import Optional

from apache_beam.metrics import monitoring_infos as mi
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.utils.timestamp import Timestamp

from beam_pyspark.metrics import TaskMetrics
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming import MIN_MICROS
from beam_pyspark.streaming.endpoints import EndpointBook
from beam_pyspark.streaming.series import StreamSeries
from beam_pyspark.streaming.series import lag_secs

# The runner's own metrics of a streaming job (result.metrics(), the
# status page, /metrics), under this namespace and step.
METRICS_NAMESPACE = 'beam_pyspark.streaming'
METRICS_STEP = 'streaming'

_DATA = {'beam:runner:source:v1', 'beam:runner:sink:v1'}
_READS = {common_urns.sdf_components.PROCESS_SIZED_ELEMENTS_AND_RESTRICTIONS.urn,
          common_urns.primitives.TEST_STREAM.urn}


def charted_pcollections(plan: ExecutionPlan) -> tuple[set, set]:
  """(the PCollections reads output, those the last transforms read)."""
  read, emitted = set(), set()
  components = beam_runner_api_pb2.Components.FromString(plan.components)
  for transform in components.transforms.values():
    if transform.spec.urn == common_urns.primitives.TEST_STREAM.urn:
      read.update(transform.outputs.values())
  for stage in plan.stages:
    if not stage.descriptor:
      continue
    descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
        stage.descriptor)
    consumed = {p for t in descriptor.transforms.values()
                for p in t.inputs.values()}
    for transform in descriptor.transforms.values():
      urn = transform.spec.urn
      if urn in _READS:
        read.update(transform.outputs.values())
      elif urn not in _DATA and transform.inputs and not (
          set(transform.outputs.values()) & consumed):
        emitted.update(transform.inputs.values())
  return read, emitted


def _counts(reports: Iterable, pcolls: set) -> int:
  return sum(
      int(mi.extract_counter_value(info)) for info in reports
      if info.urn == mi.ELEMENT_COUNT_URN and
      info.labels.get(mi.PCOLLECTION_LABEL) in pcolls)


class BatchLog:
  """What each micro-batch did: a detailed job message, metrics, the
  last ones kept for the status page and their points for its charts."""
  def __init__(self, plan: Optional[ExecutionPlan] = None, keep: int = 100):
    self.recent: list = []
    self._keep = keep
    self.series = StreamSeries()
    self._read, self._emitted = (
        charted_pcollections(plan) if plan is not None else (set(), set()))

  def add(self, index: int, secs: float, waves: int, grants: dict,
          granted: int, book: EndpointBook, graph, names: dict[str, str],
          reads: Iterable[str], reports: list) -> tuple[str, list[bytes]]:
    """(the job message, serialized MonitoringInfos) of micro-batch
    ``index``: ``graph`` the job's WatermarkGraph, ``names`` its nodes'
    display names, ``reads`` its splittable nodes, ``reports`` the job's
    task reports so far (TaskMetrics)."""
    budget = sum(g for g in grants.values() if g is not None)
    backlog = sum(e.backlog or 0 for e in book.of_all())
    self.recent = (self.recent + [{
        'batch': index, 'secs': round(secs, 3), 'waves': waves,
        'endpoints_read': granted, 'granted_records': budget,
        'endpoints_left': len(book), 'backlog': backlog}])[-self._keep:]
    watermarks = {names.get(n, n): graph.output_watermark(n) for n in reads}
    merged = TaskMetrics()
    merged.add(reports)
    committed = merged.committed()
    point = self.series.add(
        batch=index, time=time.time(), secs=secs,
        read=_counts(committed, self._read),
        emitted=_counts(committed, self._emitted),
        read_watermarks=watermarks,
        stage_watermarks={names.get(n, n): w['output']
                          for n, w in graph.snapshot().items()},
        backlog=backlog,
        endpoint_backlogs={e.endpoint_id: e.backlog for e in book.of_all()})
    text = f'Micro-batch {index}: {secs:.2f} s, {waves} wave(s)'
    if granted or book:
      text += (f'; read {granted} restriction(s) granted {budget} record(s), '
               f'{len(book)} left (backlog {backlog:g})')
    return text, [m.SerializeToString() for m in _batch_metrics(
        secs, budget, len(book), backlog, watermarks, point)]


def _batch_metrics(secs: float, granted: int, endpoints: int, backlog: float,
                   watermarks: dict[str, int], point: dict) -> list:
  from apache_beam.metrics.cells import DistributionData
  from apache_beam.metrics.cells import GaugeData
  ns, step = METRICS_NAMESPACE, METRICS_STEP
  millis = int(secs * 1000)
  now = int(time.time() * 1000)

  def gauge(name, value, transform=step):
    return mi.int64_user_gauge(ns, name, GaugeData(int(value), now),
                               ptransform=transform)

  infos = [
      mi.int64_user_counter(ns, 'micro_batches', 1, ptransform=step),
      mi.int64_user_counter(ns, 'records_granted', granted, ptransform=step),
      mi.int64_user_distribution(
          ns, 'micro_batch_millis',
          DistributionData(millis, 1, millis, millis), ptransform=step),
      gauge('endpoints', endpoints),
      gauge('backlog', backlog),
      gauge('records_read_per_sec', point['read_per_sec']),
      gauge('records_emitted_per_sec', point['emitted_per_sec']),
  ]
  for read, micros in sorted(watermarks.items()):
    if MIN_MICROS < micros < MAX_MICROS:
      infos.append(gauge('output_watermark_millis', micros // 1000, read))
  for kind, lags in (('read', point['read_lag']),
                     ('stage', point['stage_lag'])):
    for name, lag in lags.items():
      if lag is not None:
        infos.append(gauge(f'{kind}_watermark_lag_millis', lag * 1000, name))
  return infos


def _when(micros: Optional[int]) -> Optional[str]:
  """A watermark for people: ISO time, or -inf/+inf."""
  if micros is None:
    return None
  if micros <= MIN_MICROS:
    return '-inf'
  if micros >= MAX_MICROS:
    return '+inf'
  return Timestamp(micros=micros).to_utc_datetime().isoformat() + 'Z'


def streaming_status(watermarks: dict, names: dict, book: EndpointBook,
                     log: BatchLog, granted: dict) -> dict:
  """A streaming job's state for its status page, as plain data: each
  stage's input and output watermarks (``WatermarkGraph.snapshot()``) and
  lag, each live restriction (its stage, last grant, backlog, watermark,
  when it may run again), the last micro-batches, and the charts' points
  ('series': the last micro-batches' and since the job started)."""
  now = time.time()
  return {
      'watermarks': {
          names.get(node, node): {'input': _when(w['input']),
                                  'output': _when(w['output']),
                                  'lag (s)': lag_secs(now, w['output']),
                                  'holds': len(w['holds'])}
          for node, w in watermarks.items()},
      'endpoints': {
          e.endpoint_id: {
              'stage': names.get(e.node, e.node),
              'last grant': granted.get(e.endpoint_id),
              'position': e.position,
              'backlog': e.backlog,
              'watermark': _when(e.watermark if e.watermark is not None
                                 else MIN_MICROS),
              'resumes in (s)': max(0.0, round(e.resume_at / 1e6 - now, 3))}
          for e in book.of_all()},
      'micro_batches': log.recent[-20:],
      'series': log.series.snapshot(),
  }
