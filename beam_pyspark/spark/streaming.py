"""The streaming engine: a plan run in micro-batches, each in waves.

A micro-batch is what one trigger of the job's query offers
(``spark.sources``): a TestStream's events up to its next advance, each
run to quiescence in turn, and records granted to the live restrictions
of its splittable reads (``spark.streamreads``); the first also runs what
bounded sources hold. The plan runs in *waves*: one pass over the stages
in producer order, each handed what its producers wrote in that wave.
Between waves the driver moves the watermarks (``streaming.watermarks``,
with the holds tasks report) and runs another while timers are due.

Keyed work keeps state between waves (``worker.streaming``): Beam's
trigger driver per key, user state and timers, written per partition under
the checkpoint location (``worker.statestore``; crc32 partitions fixed for
the job's life). Side inputs are all their PCollection produced so far.

After each batch the driver commits it (``spark.checkpoints``), then the
bundles waiting for it are finalized; a driver started again with the same
pipeline and location resumes after the last committed batch. Cancel fails
the running batch at its next Spark action, ``stop`` lets it commit.
"""

from __future__ import annotations

import time
from typing import Optional

from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.common import ENCODED_IMPULSE_VALUE
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.metrics import TaskMetrics
from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.spark import batchlog
from beam_pyspark.spark import tasks
from beam_pyspark.spark.checkpoints import after_failure
from beam_pyspark.spark.checkpoints import JobCheckpoint
from beam_pyspark.spark.checkpoints import default_location
from beam_pyspark.spark.checkpoints import stable_node_names
from beam_pyspark.spark.controls import WaveControls
from beam_pyspark.spark.partitioning import shuffle_chunks
from beam_pyspark.spark import sources
from beam_pyspark.spark import streamreads
from beam_pyspark.spark.keyed import KeyedPartitions
from beam_pyspark.spark.stagegraph import StageGraph
from beam_pyspark.spark.stagegraph import group_node
from beam_pyspark.spark.translate import SparkPipelineJob
from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming.checkpoints import fingerprint
from beam_pyspark import storage
from beam_pyspark.streaming.teststream import TestStreamBatch
from beam_pyspark.worker.streaming import HELD_TAG
from beam_pyspark.worker.streaming import REPORT_TAG
from beam_pyspark.worker.streaming import Clocks

_DETAILED = beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_DETAILED

# Waves in one settling of the watermarks before the job is failed: timers
# that keep setting timers due at once never settle.
MAX_WAVES = 10000


def create_streaming_engine(plan, job_id, options, log):
  """The streaming engine (engine.ENGINES) on the user's running
  SparkContext, or one started for ``options``."""
  from beam_pyspark.spark.session import spark_context
  sc = spark_context(options.master, options.conf)
  return StreamingPipelineJob(sc, plan, job_id, options, log)


class StreamingPipelineJob(SparkPipelineJob):
  """Runs one plan as a streaming job (an engine.Engine)."""
  def __init__(self, sc, plan, job_id, options=None, log=None):
    super().__init__(sc, plan, job_id, options, log)
    self._nodes = StageGraph(plan, self._producers)
    self._graph = self._nodes.graph
    self._keyed = KeyedPartitions()
    self._side_history: dict[bytes, list[bytes]] = {}
    self._side_done: set[bytes] = set()
    # Stages with side inputs: main input held back until its side inputs
    # are ready, as (input id, encoded element), and the side watermarks
    # it was last tried at.
    self._held: dict[str, list] = {}
    self._held_at: dict[str, tuple] = {}
    self._first_wave = True
    self._now = self._arrival = 0
    self._waves = 0
    self._event: Optional[dict] = None  # a TestStream event: tag -> elements
    self._batches: list[TestStreamBatch] = []
    self._teststream = any(s.kind == 'teststream' for s in plan.stages)
    self._committed = -1  # the last micro-batch committed
    # The live restrictions of splittable stages between micro-batches.
    self._reads = streamreads.StreamReads(
        plan, self.options, most_endpoints=2 * self._parallelism)
    self._endpoints = self._reads.book
    if self.options.fast_path:  # stateless stages, as in batch
      self._fast, self._fast_note = streamreads.fast_paths(
          plan, self._runtime, self._reads.splittable)
    self._finished = self._stop = False
    self._deferred_seen = 0
    self._log = batchlog.BatchLog(plan)
    self._controls: Optional[WaveControls] = None  # keyed nodes' reports
    self._keyed_outs: dict = {}  # node -> its output without them
    self._query: Optional[sources.Query] = None
    self._checkpoint: Optional[JobCheckpoint] = None

  def describe(self) -> str:
    return f'Spark {self.sc.master}, streaming'

  def _release_harnesses(self) -> None:
    if not getattr(self._query, 'starting', True):  # else no stage ran here
      super()._release_harnesses()

  def stop(self) -> None:
    """Stops the job after its running micro-batch commits (at once before)."""
    self._stop = True
    if getattr(self._query, 'starting', True):
      self.cancel()

  def streaming_status(self) -> dict:
    """Watermarks, live restrictions and the last micro-batches, for the
    status page (engine.OPTIONAL_METHODS)."""
    return batchlog.streaming_status(
        self._graph.snapshot(), self._nodes.display_names(), self._endpoints,
        self._log, self._reads.last_grants)

  def drain(self, drained_plan) -> None:
    """Drains the job: from the next micro-batch on (offered at once) its
    reads run truncated (``drained_plan``: fused with Beam's truncate
    step), every endpoint granted, a TestStream ended; once no endpoint is
    left the job ends, its watermarks at +inf, every window fired."""
    self._reads.drain(drained_plan)
    if self._checkpoint is not None:
      sources.request_drain(self._checkpoint.location)

  def _open(self) -> None:
    super()._open()
    self._ctx.deferred = self.sc.accumulator(0)
    self._controls = WaveControls(self.sc)

  def _may_split(self, stage: StagePlan) -> bool:
    # Streaming reads are checkpointed by their limits instead
    # (worker.endpoints): what is left runs in a later micro-batch.
    return False

  # -- the watermark graph ------------------------------------------------------

  def _clocks(self, node: str) -> Clocks:
    return Clocks(
        self._graph.input_watermark(node), self._graph.output_watermark(node),
        self._arrival, self._now)

  def _retry_held(self, stage: StagePlan) -> bool:
    """Whether a stage holds main input its side inputs may now be ready
    for (their watermarks moved since it was held)."""
    return bool(self._held.get(stage.name)) and (
        tuple(sorted(self._nodes.side_watermarks(stage).items())) !=
        self._held_at.get(stage.name))

  def _pending(self) -> bool:
    """Whether some stage has work without new input: timers due, or
    held-back input to try again."""
    return any(self._due(n) for n in self._keyed.nodes_with_timers()) or any(
        self._retry_held(s) for s in self.plan.stages if s.side_inputs)

  def _due(self, node: str) -> bool:
    """Whether a keyed node has timers due at its clocks."""
    return self._keyed.due(node, self._graph.input_watermark(node), self._now)

  # -- the job --------------------------------------------------------------------

  def _execute(self) -> None:
    location = self.options.checkpoint_location
    # Raises CheckpointMismatch for another pipeline's checkpoint.
    names = stable_node_names(self.plan)
    self._checkpoint = JobCheckpoint(storage.Location.parse(
        location or default_location(self.job_id),
        storage.storage_options(self.options.job_options)), fingerprint(
            beam_runner_api_pb2.Components.FromString(self.plan.components),
            names.values()), names, log=self.log)
    try:
      self._run_batches()
    except BaseException as exn:
      if location is None:  # nobody could resume it
        self._checkpoint.delete()
      else:  # where to resume from; or, if it is gone, that it is
        after_failure(self._checkpoint, location, exn, self.log)
      raise
    self._checkpoint.delete()

  def _run_batches(self) -> None:
    self._committed = self._resume()
    self._batches = (sources.source_batches(self.plan)
                     if self._teststream else [])
    self._check_cancelled()
    if self._reads.drained is not None:  # drained before it started
      sources.request_drain(self._checkpoint.location)
    self._query = sources.Query(
        self.sc, self.job_id, self._checkpoint.location, self._run_batch,
        finished=lambda: self._finished,
        stopping=lambda: self._cancelled.is_set() or self._stop,
        options=sources.source_options(self.options, len(self._batches),
                                       self._teststream), log=self.log)
    try:
      self._query.run()
    finally:  # stopped between micro-batches: as cancelled then
      if self._stop:
        self._cancelled.set()
      self._check_cancelled()
    # The sources are exhausted: whatever processing-time timers wait for
    # fires now, as at the end of a batch job.
    self._now = MAX_MICROS
    self._settle()
    if not self._graph.done:
      self.log('The streaming job ended with watermarks held back: '
               f'{self._graph.snapshot()}')
    self._finalize_committed(final=True)

  def _run_batch(self, trigger: sources.Trigger) -> None:
    """Micro-batch ``trigger.batch``: its elements (a TestStream's) and the
    endpoints it grants records to in a wave, its watermarks and
    processing time applied, waves until nothing is due, its commit."""
    index = trigger.batch
    if index <= self._committed:
      return  # committed before the driver started again
    self._check_cancelled()
    draining = self._reads.drained is not None
    if draining:  # a TestStream ends: its watermarks go to +inf
      for node in self._nodes.tag_nodes.values():
        self._graph.set_source(node, MAX_MICROS)
    batch = sources.micro_batch(
        self._batches, index, trigger.time, self._now, self._teststream,
        draining)
    started, waves = time.monotonic(), self._waves
    self._activity = f'micro-batch {index}'  # in Spark's job descriptions
    self._arrival = self._now = max(self._now, batch.arrival_time)
    granted = self._reads.grant(trigger.grants)
    # Each TestStream event to quiescence first, as Beam's runners do.
    for i, event in enumerate(batch.events or ({},)):
      self._event = event
      self._wave()
      self._event = None
      if i == 0:
        self._reads.wave_done()
        if self._first_wave:  # bounded sources read all they hold
          self._first_wave = False
          for node in self._nodes.sources:
            self._graph.set_source(node, MAX_MICROS)
      self._settle()
    for tag, watermark in batch.watermarks.items():
      if tag in self._nodes.tag_nodes:
        self._graph.set_source(self._nodes.tag_nodes[tag], watermark)
    self._now = max(self._now, batch.processing_time)
    self._settle()
    self._finished = (index >= len(self._batches) - 1 or draining) and (
        not self._endpoints)
    # What the batch did, committed with it (a re-run counts once).
    text, infos = self._log.add(
        index, time.monotonic() - started, self._waves - waves, trigger.grants,
        granted, self._endpoints, self._graph, self._nodes.display_names(),
        self._reads.splittable, list(self._ctx.metrics.value))
    self._ctx.metrics.add([(f'@micro-batch {index}', 0, infos)])
    self._commit(index)
    self._committed = index
    self._finalize_committed()
    self.log(text, _DETAILED)

  def _finalize_committed(self, final: bool = False) -> None:
    """Once a micro-batch committed: the bundles waiting for it."""
    deferred = self._ctx.deferred.value
    if deferred != self._deferred_seen:
      self._deferred_seen = deferred
      committed = MAX_MICROS if final else self._committed
      self._action(lambda: streamreads.finalize_committed(
          self.sc, self.job_id, committed))

  def _settle(self) -> None:
    """Moves the watermarks and runs waves until nothing is due."""
    for _ in range(MAX_WAVES):
      self._graph.refresh()
      if not self._pending():
        return
      self._wave()
    raise PipelineExecutionError(
        f'Timers kept firing for {MAX_WAVES} waves without the watermarks '
        'settling: a timer that sets a timer due at once, for ever?')

  def _wave(self) -> None:
    """One pass over the stages, each handed what was written this wave."""
    self._waves += 1
    self._producer_rdds = {}
    self._buffer_rdds = {}
    self._side_chunks = {}
    self._side_done = set()
    self._controls.start()
    self._keyed_outs = {}
    broadcasts = len(self._broadcasts)
    terminal = []  # (its stage's label (spark.naming), output)
    try:
      for stage in self.plan.stages:
        self._check_cancelled()
        if not self._runs(stage):
          continue
        outputs = self._translate(stage)
        if outputs is not None and not any(
            self._consumers.get(b) for b in stage.outputs.values()):
          terminal.append((self._labels[stage.name], self._keyed_outs.get(
              streamreads.node_of(stage), outputs)))
      # Side inputs nothing read this wave still keep what was written.
      for buffer_id in self._side_buffer_ids:
        self._collect(buffer_id)
      # One Spark job runs what is left of the wave: the stages whose output
      # nothing reads; keyed ones' tasks send their reports to the driver on
      # the way (spark.controls); a keyed output no job ran runs for those.
      labels, outs = zip(*terminal) if terminal else ((), ())
      self._run_for_effects(list(outs), '; '.join(labels))
      self._run_for_effects(self._controls.unrun(), 'Beam keyed stages: reports')
      for node, control in self._controls.take():
        self._take_control(node, control)
    finally:
      self._unpersist()
      self._destroy_broadcasts(broadcasts)
      self._arrival = self._now

  def _run_for_effects(self, outs: list, site: str) -> None:
    if outs:  # its Spark stage named after what it ends (spark.naming)
      self._action(lambda: self._union(  # its RDDs made under the site
          [o.filter(tasks.nothing) for o in outs]).collect(), site=site)

  def _runs(self, stage: StagePlan) -> bool:
    """Whether ``stage`` has anything to do in this wave."""
    if stage.name in self._reads.granted:
      return True
    if stage.kind == 'teststream':
      event = self._event
      return bool(event) and any(
          event.get(tag) for tag in stage.output_tags.values())
    if stage.side_inputs and self._retry_held(stage):
      return True
    inputs = [b for b in stage.inputs.values() if b != IMPULSE_BUFFER]
    if not inputs:
      return self._first_wave
    if any(self._has_data(b) for b in inputs):
      return True
    return stage.stateful and self._due(stage.name)

  def _has_data(self, buffer_id: bytes) -> bool:
    return bool(self._producer_rdds.get(buffer_id)) or (
        tr.split_buffer_id(buffer_id)[0] == 'group' and
        self._due(group_node(buffer_id)))

  # -- the checkpoint -------------------------------------------------------------

  def _resume(self) -> int:
    """The job's state as of its last committed batch; that batch's index,
    or -1 for a job starting afresh."""
    resumed = self._checkpoint.resumed()
    if resumed is None:
      return -1
    driver = resumed.driver
    self._graph.restore(driver['graph'])
    self._keyed.restore(driver, resumed.states)
    self._held = dict(driver['held'])
    self._held_at = dict(driver['held_at'])
    self._first_wave = driver['first_wave']
    self._finished = driver['offer']['finished']
    self._now, self._arrival = driver['now'], driver['arrival']
    self._ctx.metrics.add(driver['metrics'])
    self._side_history = resumed.side_inputs
    for node, hold in self._reads.restore(
        driver['endpoints'], self._checkpoint.local_name).items():
      self._graph.set_hold(node, 'endpoints', hold)
    self.log(f'Resuming after micro-batch {resumed.batch}, the last one '
             f'committed to {self._checkpoint.path}.')
    return resumed.batch

  def _commit(self, batch: int) -> None:
    # The metrics so far, folded (the accumulator does not grow for ever).
    merged = TaskMetrics()
    merged.add(list(self._ctx.metrics.value))
    metrics = merged.compacted()
    self._ctx.metrics.value = list(metrics)
    self._checkpoint.commit(batch, {
        'graph': self._graph.snapshot(),
        **self._keyed.snapshot(),
        'held': dict(self._held),
        'held_at': dict(self._held_at),
        'first_wave': self._first_wave, 'now': self._now,
        'arrival': self._arrival,
        'metrics': metrics,
        'endpoints': self._endpoints.renamed(self._checkpoint.stable_name),
        'offer': self._reads.offer(self._keyed.next_processing_time(),
                                   self._finished),
    }, self._keyed.states, self._side_history)

  # -- stages -------------------------------------------------------------------

  def _translate(self, stage: StagePlan):
    if stage.kind == 'teststream':
      return self._test_stream(stage)
    # Draining: a read runs fused with Beam's truncate step instead.
    return super()._translate(self._reads.draining_stage(stage))

  def _test_stream(self, stage: StagePlan):
    """This batch's elements of a TestStream, per output."""
    outs = sources.teststream_outputs(self.sc, self._ctx, stage, self._event)
    for out_id, rdd in outs:
      self._producer_rdds.setdefault(stage.outputs[out_id], []).append(
          rdd.map(tasks.untag))
    return self._union([rdd for _, rdd in outs]) if outs else None

  def _run_stage_fn(self, stage: StagePlan, side, group_outputs):
    node = streamreads.node_of(stage)
    states = self._keyed.chains(node) if stage.stateful else None
    side_watermarks = None
    if stage.side_inputs and not stage.stateful:
      side_watermarks = self._nodes.side_watermarks(stage)
      self._held_at[node] = tuple(sorted(side_watermarks.items()))
    limits = self._reads.limits(node, streamreads.compact_output(  # Offsets
        stage, self._consumers, self._fast, self._side_buffer_ids))
    wave = tasks.StreamWave(node, self._clocks(node), states,
                            self._checkpoint.location, side_watermarks,
                            serial=self._waves, batch=self._committed + 1,
                            committed=self._committed, limits=limits)
    return tasks.RunStage(self._ctx, stage, side, group_outputs, wave,
                          fast=self._fast.get(stage.name))

  def _extra_inputs(self, stage: StagePlan) -> list:
    """Main input held back earlier, tried again; the endpoints granted
    records in this micro-batch, one per partition (so in a task each)."""
    extra = []
    held = self._held.pop(streamreads.node_of(stage), None)
    if held:
      extra.append(self.sc.parallelize(held, 1))
    granted = self._reads.granted_records(stage)
    if granted:
      extra.append(self.sc.parallelize(granted, len(granted)))
    return extra

  def _register_outputs(self, stage: StagePlan, out) -> None:
    node = streamreads.node_of(stage)
    if stage.kind == 'sdk' and (stage.stateful or stage.side_inputs or
                                node in self._reads.splittable):
      out = self._keyed_outs[node] = self._controls.wrap(node, out)
      if self._kind(stage).per != 'stage':  # consumers of its environment
        out = out.persist()  # would share its harness mid-pass: run apart
        self._persisted.append(out)
    super()._register_outputs(stage, out)  # persisted if read twice

  def _compact(self, buffer_id: bytes) -> bool:
    return False  # the trigger driver needs every timestamp and window

  _may_page = _compact

  # -- buffers --------------------------------------------------------------------

  def _buffer(self, buffer_id: bytes):
    if (rdd := self._buffer_rdds.get(buffer_id)) is not None:
      return rdd
    if buffer_id == IMPULSE_BUFFER:
      # The impulse fires once, in the job's first wave.
      rdd = self.sc.parallelize(
          [ENCODED_IMPULSE_VALUE] if self._first_wave else [], 1)
    elif tr.split_buffer_id(buffer_id)[0] == 'group':
      rdd = self._group(buffer_id)
    else:
      rdd = self._union(self._producer_rdds.get(buffer_id, []))
    self._buffer_rdds[buffer_id] = rdd
    return rdd

  def _group(self, buffer_id: bytes):
    """A GroupByKey's reduce side in this wave: its new records, its state."""
    node = group_node(buffer_id)
    producers = self._producer_rdds.get(buffer_id, [])
    records = (shuffle_chunks(self._union(producers), self._parallelism)
               if producers else self.sc.parallelize([], self._parallelism))
    wave = tasks.StreamWave(node, self._clocks(node), self._keyed.chains(node),
                            self._checkpoint.location, serial=self._waves)
    # Its data on; its reports (state, holds, timers) to the driver
    # (spark.controls), for _take_control at the wave's end.
    out = self._controls.wrap(node, records.mapPartitionsWithIndex(
        tasks.StreamGroup(self._ctx, self.plan.groups[buffer_id], wave)))
    if len(self._consumers.get(buffer_id, ())) > 1 or (
        buffer_id in self._side_buffer_ids):  # computed once
      out = out.persist()
      self._persisted.append(out)
    return out

  def _take_control(self, node: str, control: list) -> None:
    """A node's reports update its state, holds and timers; main input it
    held back is kept for a later wave."""
    reports = [record for tag, record in control if tag == REPORT_TAG]
    held = [record for tag, record in control if tag == HELD_TAG]
    if node in self._reads.splittable:
      # The stage's output waits for what its restrictions have yet to
      # read (the granted ones' residuals are back in the book by now).
      self._graph.set_hold(node, 'endpoints',
                           self._reads.residuals(node, control))
    if held:
      self._held[node] = [(t, element) for t, element, _ in held]
    self._graph.set_hold(node, 'held', min(
        (ts for _, _, ts in held), default=None))
    for report in reports:
      self._graph.set_hold(node, ('partition', report.partition),
                           self._keyed.report(
                               node, report, self._checkpoint.state_changed))

  def _collect(self, buffer_id: bytes) -> list[bytes]:
    """A side input: everything its PCollection produced so far."""
    history = self._side_history.setdefault(buffer_id, [])
    if buffer_id not in self._side_done:
      self._side_done.add(buffer_id)
      if self._has_data(buffer_id):
        history.extend(self._action(self._buffer(buffer_id).collect))
    return list(history)


