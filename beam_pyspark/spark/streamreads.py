"""A streaming job's splittable reads on the driver: their endpoints.

The endpoints (``streaming.endpoints``) are the live restrictions of the
job's splittable stages. A micro-batch's trigger grants some of them
records (``spark.sources``); ``StreamReads`` takes those out of the book
for the batch's first wave, hands them to the stage as input records, one
Spark partition each (so one task, one bundle each: ``worker.endpoints``),
and puts back what the stage's tasks report they left. It also says what
each micro-batch did (``BatchLog``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from apache_beam.portability.api import beam_fn_api_pb2

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.options import RunnerOptions
from beam_pyspark.planning import readbreak
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.streaming.endpoints import EndpointBook
from beam_pyspark.streaming.endpoints import byte_shares
from beam_pyspark.streaming.endpoints import to_split
from beam_pyspark.worker import endpoints as worker_endpoints
from beam_pyspark.worker import fastpath
from beam_pyspark.worker.endpoints import splittable_input

RESIDUAL_TAG = worker_endpoints.RESIDUAL_TAG
# A splittable stage's drained counterpart is named so (its harness and
# descriptor are its own); its node in the watermark graph is the stage's.
DRAIN_SUFFIX = ' [drain]'


def node_of(stage: StagePlan) -> str:
  """The watermark graph's node of a stage (a drained read is its read)."""
  return stage.name.removesuffix(DRAIN_SUFFIX)


def drained_stages(plan: ExecutionPlan, drained: ExecutionPlan,
                   splittable: set[str]) -> dict[str, StagePlan]:
  """Each splittable stage of ``plan`` -> the same stage in ``drained`` (the
  pipeline fused with Beam's truncate step before each splittable DoFn,
  as Beam drains a job), found by the buffers it writes."""
  by_outputs = {frozenset(s.outputs.values()): s for s in drained.stages}
  found = {}
  for stage in plan.stages:
    if stage.name not in splittable:
      continue
    other = by_outputs.get(frozenset(stage.outputs.values()))
    if other is None or len(other.inputs) != len(stage.inputs):
      raise PipelineExecutionError(
          f'Cannot drain {stage.name}: the pipeline fused for draining has '
          'no stage writing what it writes. Cancel the job instead.')
    descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
        other.descriptor)
    descriptor.id += DRAIN_SUFFIX
    found[stage.name] = dataclasses.replace(
        other, name=stage.name + DRAIN_SUFFIX,
        descriptor=descriptor.SerializeToString())
  return found


class StreamReads:
  def __init__(self, plan: ExecutionPlan, options: RunnerOptions,
               most_endpoints: int = 4):
    self.options = options
    # A read's busy endpoints are split while it has fewer than this.
    self.most_endpoints = most_endpoints
    self.book = EndpointBook()
    # node -> [(endpoint, grant)] granted in this micro-batch's first wave.
    self.granted: dict[str, list] = {}
    self.last_grants: dict = {}  # the last trigger's, by endpoint id
    self.splittable = {
        s.name for s in plan.stages if s.kind == 'sdk' and splittable_input(
            beam_fn_api_pb2.ProcessBundleDescriptor.FromString(s.descriptor))}
    self.plan = plan
    # Once draining: each read's drained stage (``drained_stages``).
    self.drained: Optional[dict[str, StagePlan]] = None

  def drain(self, drained: ExecutionPlan) -> None:
    """From now on each read runs drained: its restrictions truncated
    (Beam's truncate_restriction: by default an unbounded one to nothing
    left, a bounded one to itself), with no record budget."""
    self.drained = drained_stages(self.plan, drained, self.splittable)

  def draining_stage(self, stage: StagePlan) -> StagePlan:
    """The stage to run in its place: its drained self while draining."""
    if self.drained is None:
      return stage
    return self.drained.get(stage.name, stage)

  def grant(self, grants: dict) -> int:
    """Takes the trigger's granted endpoints out for this batch; how many."""
    self.granted = self.book.take(grants)
    self.last_grants = dict(grants)
    return sum(len(g) for g in self.granted.values())

  def wave_done(self) -> None:
    """After the batch's first wave: its grants are spent."""
    self.granted = {}

  def limits(self, node: str, compact: bool = False
             ) -> Optional[worker_endpoints.Limits]:
    """A splittable stage's limits for new restrictions (not endpoints
    yet): at most the batch's budget, for at most the read time, in their
    first bundle (draining: the time only). ``compact``: its output may
    be ``worker.sequence.Offsets`` (``compact_output``)."""
    if node not in self.splittable:
      return None
    options = self.options
    if self.drained is not None:
      return worker_endpoints.Limits(None, options.read_secs)
    return worker_endpoints.Limits(options.records_per_batch,
                                   options.read_secs, options.bytes_per_batch,
                                   compact)

  def granted_records(self, stage: StagePlan) -> list:
    """The stage's granted endpoints as input records."""
    granted = self.granted.get(node_of(stage))
    if not granted:
      return []
    if self.drained is not None:
      # Its restrictions enter the drained stage where its own take them.
      inputs = {b: i for i, b in stage.inputs.items()}
      original = next(s for s in self.plan.stages if s.name == node_of(stage))
      return [(worker_endpoints.ENDPOINT_TAG, worker_endpoints.Granted(
          e.endpoint_id,
          inputs.get(original.inputs.get(e.input_id), e.input_id),
          e.element, None)) for e, _ in granted]
    shares = byte_shares([e.endpoint_id for e, _ in granted],
                         self.options.bytes_per_batch)
    # Those still in the book, and those granted (back as residuals soon).
    live = len(self.book.of(node_of(stage))) + len(granted)
    split = to_split(granted, live, self.most_endpoints)
    return [(worker_endpoints.ENDPOINT_TAG, worker_endpoints.Granted(
        e.endpoint_id, e.input_id, e.element, grant, shares[e.endpoint_id],
        e.endpoint_id in split)) for e, grant in granted]

  def offer(self, next_processing: Optional[int], finished: bool) -> dict:
    """What the query's source offers the next micro-batch from: the
    endpoints, when the next processing-time timer is due, whether the
    job's sources are done (no micro-batch is offered any more)."""
    return {'endpoints': self.book.offer(),
            'next_processing': next_processing, 'finished': finished,
            'busy': any(e.busy for e in self.book.of_all())}

  def restore(self, saved: dict, rename) -> dict[str, Optional[int]]:
    """The endpoints a checkpoint committed; each node's hold."""
    self.book.restore(saved, rename=rename)
    return {node: self.book.hold(node) for node in self.book.nodes()}

  def residuals(self, node: str, control: list) -> Optional[int]:
    """What a splittable stage's tasks left, back into the book; the
    node's new hold (its endpoints' minimum watermark)."""
    for tag, r in control:
      if tag == RESIDUAL_TAG:
        self.book.add(node, r.input_id, r.element, r.watermark, r.resume_at,
                      r.backlog, r.parent, r.busy, r.position)
    return self.book.hold(node)


def compact_output(stage: StagePlan, consumers: dict, fast: dict,
                   side_buffers: set) -> bool:
  """Whether a splittable stage may hand its output on as compact chunks
  (``worker.sequence.Offsets``, if it is a PeriodicImpulse read): its one
  output read only by fast-path stages (``fastpath._Input`` reads the
  chunks; a harness that takes a stage over encodes them, ``StageRunner``),
  directly or through the Reshuffle ``planning.readbreak`` adds (it deals
  chunks whole and moves its input's bytes as they are)."""
  if len(stage.outputs) != 1:
    return False
  (buffer_id, ) = stage.outputs.values()
  return _read_compact(buffer_id, consumers, fast, side_buffers)


def _read_compact(buffer_id: bytes, consumers: dict, fast: dict,
                  side_buffers: set) -> bool:
  """Whether every reader of a PCollection's buffer (not a GroupByKey's
  input, whose records a task keys, nor a side input, collected as bytes)
  reads compact chunks."""
  readers = consumers.get(buffer_id, ())
  if (not readers or not buffer_id.startswith(b'materialize:') or
      buffer_id in side_buffers):
    return False
  for reader in readers:
    if (reader.kind == 'reshuffle' and len(reader.outputs) == 1 and
        readbreak.spreads_chunks(reader.transform_names) and
        not reader.sized and not reader.keeps_keys and
        list(reader.input_coders.values()) == list(
            reader.output_coders.values())):
      (spread, ) = reader.outputs.values()
      if not _read_compact(spread, consumers, fast, side_buffers):
        return False
    elif not (reader.kind == 'sdk' and not reader.stateful and
              reader.name in fast):
      return False
  return True


def finalize_committed(sc, job_id: str, committed: int) -> None:
  """Finalizes the bundles of micro-batches up to ``committed`` that wait in
  the Python workers (worker.finalization), with a task per worker slot; a
  worker this misses finalizes them at its next task of the job, or when
  the job is released."""
  from beam_pyspark.spark import naming
  from beam_pyspark.spark import release
  slots = 2 * max(1, sc.defaultParallelism)
  with naming.call_site(sc, f'Beam job {job_id}: finalize the bundles of '
                        f'micro-batches up to {committed}'):
    sc.parallelize(range(slots), slots).foreach(
        release.FinalizeCommitted(job_id, committed))


def fast_paths(plan: ExecutionPlan, runtime, splittable: set[str]) -> tuple:
  """A streaming job's stages that take the fast path (``fastpath.choose``):
  those that keep nothing between elements and wait for nothing, so run as
  in a batch job: no state or timers, no side inputs (whose readiness holds
  input back), no restrictions (which the endpoints checkpoint)."""
  return fastpath.choose([
      s for s in plan.stages if s.kind == 'sdk' and not s.stateful and
      not s.timers and not s.side_inputs and s.name not in splittable],
      runtime)
