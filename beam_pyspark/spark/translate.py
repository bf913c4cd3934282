"""An ExecutionPlan as Spark RDD jobs.

Buffers between stages are RDDs of encoded bytes, never decoded Python
objects:

* impulse        -> parallelize([encoded impulse])
* materialize    -> chunks of encoded elements; several producers -> union
* group          -> (encoded key, encoded element), shuffled with a stable
                    hash, grouped on the reduce side (worker.shuffle.grouping)
* reshuffle      -> elements spread over partitions; SDF restrictions packed
                    by size, largest first
* stateful stage -> input partitioned by encoded key
* side input     -> collected on the driver, turned into state entries,
                    broadcast

Each stage runs in executors (``mapPartitionsWithIndex`` over a StageRunner);
an output read twice, or a stage's several outputs, persisted (no recompute).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable
from typing import Optional

from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.common import ENCODED_IMPULSE_VALUE
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.errors import JobCancelledError
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.messages import forwarded
from beam_pyspark.messages import to_python_logging
from beam_pyspark.metrics import TaskMetrics
from beam_pyspark.options import RunnerOptions
from beam_pyspark.planning import readbreak
from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning.names import stage_label
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.spark import chains
from beam_pyspark.spark import naming
from beam_pyspark.spark import tasks
from beam_pyspark.spark.dependencies import ship_dependencies
from beam_pyspark.spark.failures import group_budget
from beam_pyspark.spark.failures import memory_hint
from beam_pyspark.spark.failures import spark_failure_message
from beam_pyspark.spark.partitioning import pack_by_size
from beam_pyspark.spark.partitioning import shuffle_chunks
from beam_pyspark.spark.partitioning import stable_hash
from beam_pyspark.spark.progress import ProgressTracker
from beam_pyspark.spark.progress import cancel_group
from beam_pyspark.spark.reads import split_rdd
from beam_pyspark.spark.release import release_harnesses
from beam_pyspark.worker.bundles import RESIDUAL_TAG
from beam_pyspark.worker.endpoints import splittable_input
from beam_pyspark.worker import fastpath
from beam_pyspark.worker import harnesses
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.shuffle import is_global_bytes_kv
from beam_pyspark.worker.state import side_input_entries

_LOGGER = logging.getLogger(__name__)


def create_batch_engine(plan: ExecutionPlan, job_id: str,
                        options: RunnerOptions,
                        log: Callable[..., None]) -> 'SparkPipelineJob':
  """The batch engine (engine.ENGINES): the plan as Spark jobs on the
  user's running SparkContext, or one started for ``options``."""
  from beam_pyspark.spark.session import spark_context
  sc = spark_context(options.master, options.conf)
  return SparkPipelineJob(sc, plan, job_id, options, log,
                          fast_path=options.fast_path)


class SparkPipelineJob:
  """Runs one plan on one SparkContext as a batch job (an engine.Engine);
  cancellable, and its metrics readable, from another thread."""
  def __init__(self, sc, plan: ExecutionPlan, job_id: str,
               options: Optional[RunnerOptions] = None,
               log: Callable[..., None] = None, fast_path: bool = False):
    """``fast_path``: run eligible stages as plain loops (worker.fastpath);
    batch only, so off unless the batch engine's factory turns it on."""
    self.sc = sc
    self.plan = plan
    self.job_id = job_id
    self.options = options or RunnerOptions()
    # log(text, importance): the job's message stream.
    self.log = log or to_python_logging(_LOGGER)
    self._ctx = None
    self._cancelled = threading.Event()
    self._runtime = JobRuntime(job_id, plan.components)
    self._parallelism = self.options.parallelism or max(
        2, sc.defaultParallelism)
    # A global combine's GroupByKey has one key: one reduce partition.
    self._partitions = {b: 1 for b, g in plan.groups.items() if g.one_key}
    self._consumers = plan.consumers()
    self._producers = plan.producers()
    self._producer_rdds: dict[bytes, list] = {}
    self._buffer_rdds: dict[bytes, object] = {}
    self._side_chunks: dict[bytes, list[bytes]] = {}
    self._persisted: list = []
    self._side_buffer_ids = {
        si.buffer_id for s in plan.stages for si in s.side_inputs}
    self._broadcasts: list = []
    self._shipment = None  # the job's dependencies, while it runs
    self._group_budget = group_budget(sc, self.options.group_memory_mb)
    self._succeeded = False
    self._progress = ProgressTracker(sc, job_id)
    self._fast, self._fast_note = (
        fastpath.choose(plan.stages, self._runtime) if fast_path else ({}, ''))
    # Stage labels (spark.naming); those built since the last Spark job.
    self._labels = {
        s.name: stage_label(i, s) for i, s in enumerate(plan.stages)}
    self._unlaunched: list[str] = []
    self._activity = ''  # e.g. 'micro-batch 7' (streaming)

  # -- public ---------------------------------------------------------------

  def run(self) -> None:
    try:
      self._open()
      self._execute()
      self._succeeded = True
    finally:
      self._close()

  def _open(self) -> None:
    """The job's Spark side: its job group, broadcast components, task
    context (accumulators) and shipped dependencies."""
    sc = self.sc
    sc.setJobGroup(self.job_id, f'Beam job {self.job_id}', True)
    components = sc.broadcast(self.plan.components)
    self._broadcasts.append(components)
    self._ctx = tasks.TaskContext(
        job_id=self.job_id,
        components=components,
        metrics=sc.accumulator([], tasks.ListAccumulator()),
        bundle_bytes=self.options.bundle_bytes,
        python_path=tasks.driver_paths(),
        logs=sc.accumulator([], tasks.ListAccumulator()),
        log_level=self.options.log_level,
        log_overrides=self.options.log_overrides,
        pipeline_options=self.options.job_options,
        split_after_secs=self.options.split_stragglers_after_secs,
        worker_console_logs=not sc.master.startswith('local'),
        held=sc.accumulator([], tasks.ListAccumulator()))
    self._logs_forwarded = 0
    self._shipment = ship_dependencies(sc, self.plan, self.log)
    if self._shipment is not None:
      self._ctx.dependencies = self._shipment.shipped

  def _execute(self) -> None:
    """Batch: every stage's RDDs, then one action over the stages whose
    output nothing reads."""
    if self._fast_note:
      self.log(self._fast_note)
    terminal, last = [], []
    for stage in self.plan.stages:
      self._check_cancelled()
      outputs = self._translate(stage)
      if outputs is not None and not any(
          self._consumers.get(b) for b in stage.outputs.values()):
        terminal.append(outputs)
        last.append(naming.short(self._labels[stage.name]))
    self._check_cancelled()
    if terminal:
      with naming.call_site(self.sc, ', '.join(last) + ' (output)'):
        self._action(lambda: self._union(terminal).foreach(tasks.consume))

  def _close(self) -> None:
    self._forward_logs()
    try:  # the job's last progress, read by the execution once it ends
      self._progress.snapshot(max_age=0)
    except Exception:  # pylint: disable=broad-except
      _LOGGER.debug('No final progress for %s', self.job_id, exc_info=True)
    self._release_harnesses()
    self._unpersist()
    self._destroy_broadcasts(0)
    if self._shipment is not None:  # no longer served to executors
      self._shipment.close()

  def _destroy_broadcasts(self, first: int) -> None:
    for b in self._broadcasts[first:]:  # those made since the first-th
      with contextlib.suppress(Exception):
        b.destroy()
    del self._broadcasts[first:]

  def _unpersist(self) -> None:
    for rdd in self._persisted:
      with contextlib.suppress(Exception):
        rdd.unpersist()
    self._persisted = []

  def cancel(self) -> None:
    self._cancelled.set()
    cancel_group(self.sc, self.job_id)

  def metrics(self) -> tuple[list, list]:
    """(committed, attempted) so far: the reports of every task finished.

    Spark merges a task's accumulator updates on the driver when the task
    ends, so this grows while the job runs.
    """
    ctx = self._ctx
    if ctx is None:
      return [], []
    merged = TaskMetrics()
    merged.add(list(ctx.metrics.value))
    return merged.committed(), merged.attempted()

  def describe(self) -> str:
    return f'Spark {self.sc.master}'

  def progress(self) -> dict:
    """Spark tasks of the job's group (spark.progress), and per fused
    stage the tasks that reported so far ('beam_stages')."""
    progress = dict(self._progress.snapshot())
    ctx = self._ctx
    reports = TaskMetrics()
    if ctx is not None:
      reports.add(list(ctx.metrics.value))
    progress['beam_stages'] = reports.tasks_done()
    return progress

  def _release_harnesses(self) -> None:
    """Best effort: stop the job's harnesses when the job ends (spark.release);
    harness processes before the job is reported done, as a program that
    exits right after its pipeline would leave them (release_waits)."""
    release_harnesses(
        self.sc, self.job_id, self._succeeded, held=tasks.held(self._ctx),
        wait=harnesses.release_waits(self._runtime.components, self.plan))

  def _kind(self, stage: StagePlan) -> harnesses.HarnessKind:
    """The kind of harness that runs the stage."""
    env = (self._runtime.components.environments[stage.environment_id]
           if stage.environment_id else None)
    return harnesses.kind_for(env)

  # -- stages ---------------------------------------------------------------

  def _translate(self, stage: StagePlan):
    label = self._labels.get(stage.name, stage.name)
    self._unlaunched.append(label)
    with naming.call_site(self.sc, label):
      if stage.kind == 'reshuffle':
        return self._reshuffle(stage)
      if stage.kind == 'read':
        return self._read(stage)
      return self._sdk_stage(stage)

  def _sdk_stage(self, stage: StagePlan):
    sc = self.sc
    inputs = []
    for transform_id, buffer_id in stage.inputs.items():
      if stage.stateful and buffer_id != IMPULSE_BUFFER:
        continue
      rdd = self._buffer(buffer_id)
      inputs.append(rdd.map(tasks.Tag(transform_id)))
    if stage.stateful:
      keyed = [
          self._buffer(buffer_id).mapPartitions(
              tasks.KeyElements(self._ctx, stage.input_coders[transform_id],
                                transform_id))
          for transform_id, buffer_id in stage.inputs.items()
          if buffer_id != IMPULSE_BUFFER
      ]
      if keyed:
        inputs.append(
            sc.union(keyed).partitionBy(self._parallelism, stable_hash)
            .mapPartitions(tasks.pack_tagged, preservesPartitioning=True))
    inputs.extend(self._extra_inputs(stage))
    input_rdd = self._union(inputs)

    side = None
    if stage.side_inputs:
      entries = [
          side_input_entries(self._runtime, spec, self._collect(spec.buffer_id))
          for spec in stage.side_inputs
      ]
      side = sc.broadcast(entries)
      self._broadcasts.append(side)

    group_outputs = {
        transform_id: (stage.output_coders[transform_id],
                       self._partitions.get(buffer_id, self._parallelism),
                       self._compact(buffer_id))
        for transform_id, buffer_id in stage.outputs.items()
        if tr.split_buffer_id(buffer_id)[0] == 'group'
    }
    run = self._run_stage_fn(stage, side, group_outputs)
    out = input_rdd.mapPartitionsWithIndex(run)
    if self._may_split(stage):
      out = self._split_rounds(stage, out, run)
    self._register_outputs(stage, out)
    return out

  def _extra_inputs(self, stage: StagePlan) -> list:
    """RDDs of (input id, chunk) a stage reads besides its buffers."""
    return []

  def _run_stage_fn(self, stage: StagePlan, side, group_outputs):
    """The function a stage's tasks run over their partitions."""
    return tasks.RunStage(self._ctx, stage, side, group_outputs,
                          fast=self._fast.get(stage.name))

  def _may_split(self, stage: StagePlan) -> bool:
    """A splittable stage in its own harness: the runner may split it."""
    if stage.stateful or not self._kind(stage).splits_bundles:
      return False
    if self.options.split_stragglers_after_secs <= 0:
      return False
    return splittable_input(
        beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
            stage.descriptor)) is not None

  def _split_rounds(self, stage: StagePlan, out, run):
    """Runs what straggling bundles split off in further rounds of tasks.

    Each round's output is kept (persisted); its split residuals are spread
    over the cluster and run by the same stage until no bundle splits.
    """
    rounds = []
    while True:
      out = out.persist()
      self._persisted.append(out)
      rounds.append(out.filter(tasks.NotTag(RESIDUAL_TAG)))
      residual = out.filter(tasks.HasTag(RESIDUAL_TAG)).map(tasks.untag)
      count = self._action(
          residual.count, f'residuals of {self._labels.get(stage.name)}')
      if not count:
        break
      self.log(
          f'{stage.name}: {count} residual(s) split off straggling bundles '
          'run in another round of tasks')
      out = residual.repartition(
          min(count, self._parallelism)).mapPartitionsWithIndex(run)
    return self._union(rounds)

  def _reshuffle(self, stage: StagePlan):
    (in_id, buffer_id), = stage.inputs.items()
    source = self._buffer(buffer_id)
    if not stage.outputs:
      # Nothing reads it (Beam's Go test LPErrorReshufflePipeline): what it
      # reshuffles is still computed, as the job's terminal output.
      return source
    (out_id, _), = stage.outputs.items()
    transcode = tasks.Transcode(
        self._ctx, stage.input_coders[in_id], stage.output_coders[out_id])
    if stage.sized:
      sized = self._action(
          lambda: source.mapPartitions(
              tasks.SizedElements(self._ctx, stage.input_coders[in_id]))
          .collect(), 'the sizes of restrictions to pack')
      bins = pack_by_size([s for s, _ in sized], self._parallelism)
      self.log(f'{stage.name}: {len(sized)} restrictions packed into '
               f'{len(bins)} partitions by size')
      packed = [[sized[i][1] for i in b] for b in bins] or [[]]
      out = self.sc.parallelize(packed, len(packed)).flatMap(
          tasks.identity).mapPartitions(transcode)
    elif stage.keeps_keys:  # a key's elements in one partition
      n = self._parallelism
      out = source.mapPartitions(tasks.KeyedSpread(
          self._ctx, stage.input_coders[in_id], n)).partitionBy(
              n, tasks.identity).values().mapPartitions(transcode)
    else:
      out = (
          source.mapPartitionsWithIndex(tasks.SpreadElements(
              self._ctx, stage.input_coders[in_id], self._parallelism,
              readbreak.spreads_chunks(stage.transform_names)))
          .partitionBy(self._parallelism, tasks.identity).values()
          .mapPartitions(transcode))
    tagged = out.map(tasks.Tag(out_id))
    self._register_outputs(stage, tagged)
    return tagged

  def _read(self, stage: StagePlan):
    """A bounded source split on the driver: one element per split."""
    (out_id, _), = stage.outputs.items()
    out = split_rdd(
        self.sc, self._ctx, self._runtime, stage, self._parallelism,
        self.log, self._action).map(tasks.Tag(out_id))
    self._register_outputs(stage, out)
    return out

  def _register_outputs(self, stage: StagePlan, out) -> None:
    reads = sum(
        len(self._consumers.get(b, ())) for b in set(stage.outputs.values()))
    if len(stage.outputs) > 1 or reads > 1 or any(
        b in self._side_buffer_ids for b in stage.outputs.values()):
      out = out.persist()
      self._persisted.append(out)
    single = len(stage.outputs) == 1
    for transform_id, buffer_id in stage.outputs.items():
      rdd = out.map(tasks.untag) if single else out.filter(
          tasks.HasTag(transform_id)).map(tasks.untag)
      self._producer_rdds.setdefault(buffer_id, []).append(rdd)

  # -- buffers --------------------------------------------------------------

  def _union(self, rdds: list):
    """One RDD of all of ``rdds``: the only one as it is, none as empty."""
    if not rdds:
      return self.sc.parallelize([], 1)
    return rdds[0] if len(rdds) == 1 else self.sc.union(rdds)

  def _buffer(self, buffer_id: bytes):
    rdd = self._buffer_rdds.get(buffer_id)
    if rdd is not None:
      return rdd
    sc = self.sc
    if buffer_id == IMPULSE_BUFFER:
      rdd = sc.parallelize([ENCODED_IMPULSE_VALUE], 1)
    else:
      producers = self._producer_rdds.get(buffer_id, [])
      if not producers:
        if buffer_id in self._producers:
          # Translating stages out of order would read nothing, silently.
          raise RuntimeError(
              f'buffer {buffer_id!r} is read before the stage that writes '
              'it was translated: the plan is not in producer order')
      # None (e.g. a Flatten of no inputs): an empty PCollection.
      source = self._union(producers)
      kind, _ = tr.split_buffer_id(buffer_id)
      if kind == 'group':
        # Producers packed their records per reduce partition (RunStage);
        # Spark moves the chunks, the reduce side groups within a budget.
        spec = self.plan.groups[buffer_id]
        with naming.call_site(self.sc, naming.shuffle_site(
            [self._labels[p.name] for p in self._producers.get(buffer_id, ())],
            spec.transform_name)):  # its map side: the writers' Spark stage
          chunks = shuffle_chunks(
              source, self._partitions.get(buffer_id, self._parallelism))
        rdd = chunks.mapPartitions(
            tasks.GroupValues(
                self._ctx, spec, self._group_budget,
                self._may_page(buffer_id), self._compact(buffer_id)))
      else:
        rdd = chains.cut_if_deep(source)
    self._buffer_rdds[buffer_id] = rdd
    return rdd

  def _compact(self, buffer_id: bytes) -> bool:
    """Whether a group's shuffle carries only key and value bytes: the
    default windowing over a global-window KV<bytes, bytes>."""
    spec = self.plan.groups[buffer_id]
    return spec.default_windowing and is_global_bytes_kv(
        self._runtime.coder(spec.safe_input_coder_id))

  def _may_page(self, buffer_id: bytes) -> bool:
    """Whether a group's large value lists may be paged to its consumers.

    Pages live in the task that grouped them, so every consumer must read
    the group as the main input of a stage run in that same task: not a
    side input (collected to the driver), not a stateful stage (keyed and
    shuffled again), not a reshuffle, not a stage whose straggling bundles
    the runner splits (their residuals run in other tasks).
    """
    if buffer_id in self._side_buffer_ids:
      return False
    consumers = self._consumers.get(buffer_id, ())
    return bool(consumers) and all(
        c.kind == 'sdk' and c.state_backed_iterables and not c.stateful and
        not self._may_split(c) for c in consumers)

  def _collect(self, buffer_id: bytes) -> list[bytes]:
    chunks = self._side_chunks.get(buffer_id)
    if chunks is None:
      rdd = self._buffer(buffer_id)
      chunks = self._side_chunks[buffer_id] = self._action(
          rdd.collect, 'a side input')
    return chunks

  # -- actions --------------------------------------------------------------

  def _check_cancelled(self) -> None:
    if self._cancelled.is_set():
      raise JobCancelledError(f'job {self.job_id} was cancelled')

  def _job_label(self) -> str:
    """How Spark's UI names this job's Spark jobs (before what they run)."""
    return f'Beam job {self.job_id}' + (
        f', {self._activity}' if self._activity else '')

  def _action(self, fn, what: str = '', site: str = ''):
    """Runs ``fn``'s Spark jobs, described (naming.described) in Spark's UI."""
    self._check_cancelled()
    text = naming.described(self._job_label(), what, self._unlaunched)
    self._unlaunched = []
    try:
      with naming.job_description(self.sc, text, f'Beam job {self.job_id}', site):
        return fn()
    except Exception as exn:  # py4j errors carry the executors' traceback
      if self._cancelled.is_set():
        raise JobCancelledError(f'job {self.job_id} was cancelled') from exn
      message = spark_failure_message(exn)
      hint = memory_hint(str(exn), self.sc.getConf())
      raise PipelineExecutionError(
          f'{message}\n\n{hint}' if hint else message) from exn
    finally:
      self._forward_logs()

  def _forward_logs(self) -> None:
    """Sends what executors logged since the last action to the job."""
    ctx = getattr(self, '_ctx', None)
    if ctx is None or ctx.logs is None:
      return
    entries = ctx.logs.value
    fresh = entries[self._logs_forwarded:]
    self._logs_forwarded = len(entries)
    for _, level, text in sorted(fresh, key=lambda e: e[0]):
      importance, text = forwarded(level, text)
      self.log(text, importance)
