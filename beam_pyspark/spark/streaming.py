"""The streaming engine: a plan run in micro-batches, each in waves.

A micro-batch is what the sources give at once (``spark.sources``): a
TestStream's elements up to its next watermark or processing-time
advance, or everything bounded sources hold, in one. One Structured
Streaming query per job runs them, ``_run_batch`` as its foreachBatch.
Within a batch the plan runs in *waves*: one pass over the stages in
producer order, each handed what its producers wrote in that wave, at the
clocks computed before it (input and output watermarks, processing time).
Between waves the driver moves the watermarks (``streaming.watermarks``,
Prism's rules, with the holds keyed tasks report) and runs another wave
while a keyed stage has timers due: a GroupByKey whose windows the
watermark closed, a stateful DoFn's event- or processing-time timers.

Keyed work keeps state between waves (``worker.streaming``): a GroupByKey
runs Beam's trigger driver per key, a stateful stage its user state and
timers; each partition writes what it changed under the checkpoint
location and reports its state's new chain of files
(``worker.statestore``), its holds and when its next timers are due. Side
inputs are all their PCollection produced so far. Partitions are fixed
for the job's life (crc32 of the encoded key, as in batch).

Cancel fails the running batch at its next Spark action, which ends the
query (``Query.stop`` only ever stops an idle query). After the last batch the
sources are exhausted: their watermarks go to +inf, processing time too,
and waves run until nothing is due.

After each batch the driver commits it (``spark.checkpoints``); a driver
started again with the same pipeline and location resumes after the last
committed batch (the one it died in runs again from the committed state).
"""

from __future__ import annotations

import collections
from typing import Optional

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.common import ENCODED_IMPULSE_VALUE
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.metrics import TaskMetrics
from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.spark import tasks
from beam_pyspark.spark.checkpoints import JobCheckpoint
from beam_pyspark.spark.checkpoints import default_location
from beam_pyspark.spark.checkpoints import stable_node_names
from beam_pyspark.spark.partitioning import shuffle_chunks
from beam_pyspark.spark.sources import Query
from beam_pyspark.spark.sources import source_batches
from beam_pyspark.spark.translate import SparkPipelineJob
from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming.checkpoints import fingerprint
from beam_pyspark.streaming.teststream import TestStreamBatch
from beam_pyspark.streaming.watermarks import WatermarkGraph
from beam_pyspark.worker.streaming import HELD_TAG
from beam_pyspark.worker.streaming import REPORT_TAG
from beam_pyspark.worker.streaming import Clocks

# Waves in one settling of the watermarks before the job is failed: timers
# that keep setting timers due at once never settle.
MAX_WAVES = 10000
def create_streaming_engine(plan, job_id, options, log):
  """The streaming engine (engine.ENGINES) on the user's running
  SparkContext, or one started for ``options``."""
  from beam_pyspark.spark.session import spark_context
  sc = spark_context(options.master, options.conf)
  return StreamingPipelineJob(sc, plan, job_id, options, log)


_CONTROL_TAGS = (REPORT_TAG, HELD_TAG)


def _is_control(record) -> bool:
  """A task's report or held-back element, not data."""
  return type(record) is tuple and record[0] in _CONTROL_TAGS


def _is_data(record) -> bool:
  return not _is_control(record)


def _group_node(buffer_id: bytes) -> str:
  return 'gbk:' + buffer_id.decode('utf-8', 'replace')


class StreamingPipelineJob(SparkPipelineJob):
  """Runs one plan as a streaming job (an engine.Engine)."""
  def __init__(self, sc, plan, job_id, options=None, log=None):
    super().__init__(sc, plan, job_id, options, log)
    self._graph = WatermarkGraph()
    self._sources: list[str] = []  # nodes exhausted after the first wave
    self._tag_nodes: dict[str, str] = {}  # TestStream tag -> its node
    # node -> partition -> its state's chain of files.
    self._states: dict[str, dict[int, tuple]] = collections.defaultdict(dict)
    self._next_event: dict[str, dict[int, int]] = collections.defaultdict(
        dict)
    self._next_processing: dict[str, dict[int, int]] = (
        collections.defaultdict(dict))
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
    self._batch: Optional[TestStreamBatch] = None
    self._batches: list[TestStreamBatch] = []
    self._committed = -1  # the last micro-batch committed
    self._query: Optional[Query] = None
    self._checkpoint: Optional[JobCheckpoint] = None
    self._build_graph()

  def describe(self) -> str:
    return f'Spark {self.sc.master}, streaming'

  # -- the watermark graph ------------------------------------------------------

  def _node_of(self, stage: StagePlan, output_id: str) -> str:
    if stage.kind == 'teststream':
      return f'{stage.name}#{stage.output_tags[output_id]}'
    return stage.name

  def _written(self, buffer_id: bytes) -> list[str]:
    """The graph's edges of the stages writing ``buffer_id``."""
    return sorted({
        f'{self._node_of(s, out)} -> {buffer_id!r}'
        for s in self._producers.get(buffer_id, ())
        for out, b in s.outputs.items() if b == buffer_id})

  def _readers_wait_for(self, buffer_id: bytes) -> list[str]:
    """The graph's edges a reader of ``buffer_id`` waits for."""
    if tr.split_buffer_id(buffer_id)[0] == 'group':
      return [_group_node(buffer_id) + ' out']
    return self._written(buffer_id)

  def _build_graph(self) -> None:
    graph = self._graph
    for stage in self.plan.stages:
      if stage.kind == 'teststream':
        for out, tag in stage.output_tags.items():
          node = self._node_of(stage, out)
          if node not in self._tag_nodes.values():
            edges = [
                f'{node} -> {b!r}' for o, b in stage.outputs.items()
                if stage.output_tags[o] == tag]
            graph.add_stage(node, outputs=sorted(set(edges)), source=True)
            self._tag_nodes[tag] = node
        continue
      inputs = [e for b in stage.inputs.values() if b != IMPULSE_BUFFER
                for e in self._readers_wait_for(b)]
      sides = [e for si in stage.side_inputs for e in self._readers_wait_for(si.buffer_id)]
      outputs = sorted({f'{stage.name} -> {b!r}'
                        for b in stage.outputs.values()})
      graph.add_stage(stage.name, inputs, outputs, sides, source=not inputs)
      if not inputs:
        self._sources.append(stage.name)
    for buffer_id in self.plan.groups:
      node = _group_node(buffer_id)
      inputs = self._written(buffer_id)
      graph.add_stage(node, inputs, [node + ' out'], source=not inputs)
      if not inputs:
        self._sources.append(node)

  def _clocks(self, node: str) -> Clocks:
    return Clocks(
        self._graph.input_watermark(node), self._graph.output_watermark(node),
        self._arrival, self._now)

  def _side_watermarks(self, stage: StagePlan) -> dict:
    """(transform id, tag) -> the watermark of each side input's buffer."""
    return {
        (si.transform_id, si.tag): min(
            (self._graph.pcollection_watermark(e)
             for e in self._readers_wait_for(si.buffer_id)), default=MAX_MICROS)
        for si in stage.side_inputs}

  def _retry_held(self, stage: StagePlan) -> bool:
    """Whether a stage holds main input its side inputs may now be ready
    for (their watermarks moved since it was held)."""
    return bool(self._held.get(stage.name)) and (
        tuple(sorted(self._side_watermarks(stage).items())) !=
        self._held_at.get(stage.name))

  def _pending(self) -> bool:
    """Whether some stage has work without new input: timers due, or
    held-back input to try again."""
    return any(self._due(node) for node in self._next_event.keys() |
               self._next_processing.keys()) or any(
                   self._retry_held(s) for s in self.plan.stages
                   if s.side_inputs)

  def _due(self, node: str) -> bool:
    """Whether a keyed node has timers due at its clocks."""
    event = min(self._next_event[node].values(), default=None)
    processing = min(self._next_processing[node].values(), default=None)
    return ((event is not None and
             event <= self._graph.input_watermark(node)) or
            (processing is not None and processing <= self._now))

  # -- the job --------------------------------------------------------------------

  def _execute(self) -> None:
    location = self.options.checkpoint_location
    # Raises CheckpointMismatch for another pipeline's checkpoint.
    names = stable_node_names(self.plan)
    self._checkpoint = JobCheckpoint(
        location or default_location(self.job_id),
        fingerprint(
            beam_runner_api_pb2.Components.FromString(self.plan.components),
            names.values()), names)
    try:
      self._run_batches()
    except BaseException:
      if location is None:  # nobody could resume it
        self._checkpoint.delete()
      else:
        self.log(f'The job\'s state as of its last committed micro-batch is '
                 f'kept in {location}: run the same pipeline with this '
                 '--checkpoint_location to resume from it.')
      raise
    self._checkpoint.delete()

  def _run_batches(self) -> None:
    self._committed = self._resume()
    self._batches = source_batches(self.plan)
    self._check_cancelled()
    self._query = Query(self.sc, self.job_id, len(self._batches),
                        self._checkpoint.path, self._run_batch)
    try:
      self._query.run()
    except Exception:  # pylint: disable=broad-except
      self._check_cancelled()
      raise
    self._check_cancelled()
    # The sources are exhausted: whatever processing-time timers wait for
    # fires now, as at the end of a batch job.
    self._now = MAX_MICROS
    self._settle()
    if not self._graph.done:
      self.log('The streaming job ended with watermarks held back: '
               f'{self._graph.snapshot()}')

  def _run_batch(self, index: int) -> None:
    """Micro-batch ``index``: its elements in a wave, its watermarks and
    processing time applied, waves until nothing is due, its commit."""
    if index <= self._committed:
      return  # committed before the driver started again
    self._check_cancelled()
    batch = self._batch = self._batches[index]
    self._arrival = self._now = max(self._now, batch.arrival_time)
    self._wave()
    self._batch = None
    if self._first_wave:
      self._first_wave = False
      for node in self._sources:
        self._graph.set_source(node, MAX_MICROS)
    for tag, watermark in batch.watermarks.items():
      if tag in self._tag_nodes:
        self._graph.set_source(self._tag_nodes[tag], watermark)
    self._now = max(self._now, batch.processing_time)
    self._settle()
    self._commit(index)
    self._committed = index

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
    broadcasts = len(self._broadcasts)
    terminal = []
    try:
      for stage in self.plan.stages:
        self._check_cancelled()
        if not self._runs(stage):
          continue
        outputs = self._translate(stage)
        if outputs is not None and not any(
            self._consumers.get(b) for b in stage.outputs.values()):
          terminal.append(outputs)
      # Side inputs nothing read this wave still keep what was written.
      for buffer_id in self._side_buffer_ids:
        self._collect(buffer_id)
      if terminal:
        self._action(lambda: self.sc.union(terminal).foreach(tasks.consume))
    finally:
      self._unpersist()
      for b in self._broadcasts[broadcasts:]:
        try:
          b.destroy()
        except Exception:  # pylint: disable=broad-except
          pass
      del self._broadcasts[broadcasts:]
      self._arrival = self._now

  def _runs(self, stage: StagePlan) -> bool:
    """Whether ``stage`` has anything to do in this wave."""
    if stage.kind == 'teststream':
      batch = self._batch
      return batch is not None and any(
          batch.elements.get(tag) for tag in stage.output_tags.values())
    if stage.side_inputs and self._retry_held(stage):
      return True
    inputs = [b for b in stage.inputs.values() if b != IMPULSE_BUFFER]
    if not inputs:
      return self._first_wave
    if any(self._has_data(b) for b in inputs):
      return True
    return stage.stateful and self._due(stage.name)

  def _has_data(self, buffer_id: bytes) -> bool:
    if tr.split_buffer_id(buffer_id)[0] == 'group':
      return bool(self._producer_rdds.get(buffer_id)) or self._due(
          _group_node(buffer_id))
    return bool(self._producer_rdds.get(buffer_id))

  # -- the checkpoint -------------------------------------------------------------

  def _resume(self) -> int:
    """The job's state as of its last committed batch; that batch's index,
    or -1 for a job starting afresh."""
    resumed = self._checkpoint.resumed()
    if resumed is None:
      return -1
    driver = resumed.driver
    self._graph.restore(driver['graph'])
    for table, saved in ((self._next_event, driver['next_event']),
                         (self._next_processing, driver['next_processing'])):
      for node, by_partition in saved.items():
        table[node].update(by_partition)
    self._held = dict(driver['held'])
    self._held_at = dict(driver['held_at'])
    self._first_wave = driver['first_wave']
    self._now, self._arrival = driver['now'], driver['arrival']
    self._ctx.metrics.add(driver['metrics'])
    for node, chains in resumed.states.items():
      self._states[node].update(chains)
    self._side_history = resumed.side_inputs
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
        'next_event': {n: dict(t) for n, t in self._next_event.items() if t},
        'next_processing': {
            n: dict(t) for n, t in self._next_processing.items() if t},
        'held': dict(self._held),
        'held_at': dict(self._held_at),
        'first_wave': self._first_wave,
        'now': self._now,
        'arrival': self._arrival,
        'metrics': metrics,
    }, self._states, self._side_history)

  # -- stages -------------------------------------------------------------------

  def _translate(self, stage: StagePlan):
    if stage.kind == 'teststream':
      return self._test_stream(stage)
    return super()._translate(stage)

  def _test_stream(self, stage: StagePlan):
    """This batch's elements of a TestStream, per output."""
    outs = []
    for out_id, tag in stage.output_tags.items():
      events = self._batch.elements.get(tag)
      if not events:
        continue
      payload = beam_runner_api_pb2.TestStreamPayload.FromString(
          stage.read_payload)
      rdd = (
          self.sc.parallelize(events, 1).mapPartitions(
              tasks.TestStreamElements(self._ctx, payload.coder_id,
                                       stage.element_coders[out_id]))
          .map(tasks.Tag(out_id)))
      outs.append(rdd)
      self._producer_rdds.setdefault(stage.outputs[out_id], []).append(
          rdd.map(tasks.untag))
    return self._union(outs) if outs else None

  def _run_stage_fn(self, stage: StagePlan, side, group_outputs):
    node = stage.name
    states = self._chains(node) if stage.stateful else None
    side_watermarks = None
    if stage.side_inputs and not stage.stateful:
      side_watermarks = self._side_watermarks(stage)
      self._held_at[node] = tuple(sorted(side_watermarks.items()))
    wave = tasks.StreamWave(node, self._clocks(node), states,
                            self._checkpoint.path, side_watermarks,
                            serial=self._waves)
    return tasks.RunStage(self._ctx, stage, side, group_outputs, wave)

  def _extra_inputs(self, stage: StagePlan) -> list:
    """Main input held back earlier, tried again."""
    held = self._held.pop(stage.name, None)
    if not held:
      return []
    return [self.sc.parallelize(held, 1)]

  def _register_outputs(self, stage: StagePlan, out) -> None:
    if stage.kind == 'sdk' and (stage.stateful or stage.side_inputs):
      out = self._keyed_output(stage.name, out)
    super()._register_outputs(stage, out)

  def _compact(self, buffer_id: bytes) -> bool:
    # The trigger driver needs every element's timestamp and windows.
    return False

  def _may_page(self, buffer_id: bytes) -> bool:
    return False

  # -- buffers --------------------------------------------------------------------

  def _buffer(self, buffer_id: bytes):
    rdd = self._buffer_rdds.get(buffer_id)
    if rdd is not None:
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
    node = _group_node(buffer_id)
    producers = self._producer_rdds.get(buffer_id, [])
    if producers:
      records = shuffle_chunks(self._union(producers), self._parallelism)
    else:
      records = self.sc.parallelize([], self._parallelism)
    wave = tasks.StreamWave(node, self._clocks(node), self._chains(node),
                            self._checkpoint.path, serial=self._waves)
    out = records.mapPartitionsWithIndex(
        tasks.StreamGroup(self._ctx, self.plan.groups[buffer_id], wave))
    return self._keyed_output(node, out)

  def _keyed_output(self, node: str, out):
    """Runs a node's tasks now: their reports update its state, holds and
    timers, and the main input they held back is kept for a later wave;
    its data is read from the persisted output."""
    out = out.persist()
    self._persisted.append(out)
    control = self._action(out.filter(_is_control).collect)
    reports = [record for tag, record in control if tag == REPORT_TAG]
    held = [record for tag, record in control if tag == HELD_TAG]
    if held:
      self._held[node] = [(t, element) for t, element, _ in held]
    self._graph.set_hold(node, 'held', min(
        (ts for _, _, ts in held), default=None))
    for report in reports:
      p = report.partition
      before = self._states[node].get(p)
      if report.state != before:
        self._checkpoint.state_changed(node, p, before, report.state)
      if report.state is None:
        self._states[node].pop(p, None)
      else:
        self._states[node][p] = report.state
      self._graph.set_hold(node, ('partition', p), report.hold)
      _set(self._next_event[node], p, report.next_event)
      _set(self._next_processing[node], p, report.next_processing)
    return out.filter(_is_data)

  def _chains(self, node: str) -> dict:
    """Each partition's state chain (a few names: tasks read the files)."""
    return dict(self._states.get(node) or {})

  def _collect(self, buffer_id: bytes) -> list[bytes]:
    """A side input: everything its PCollection produced so far."""
    history = self._side_history.setdefault(buffer_id, [])
    if buffer_id not in self._side_done:
      self._side_done.add(buffer_id)
      if self._has_data(buffer_id):
        history.extend(self._action(self._buffer(buffer_id).collect))
    return list(history)


def _set(table: dict, partition: int, value: Optional[int]) -> None:
  if value is None:
    table.pop(partition, None)
  else:
    table[partition] = value

