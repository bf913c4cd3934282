"""Picklable functions that Spark ships to executors.

Each is a small class holding only what the task needs (broadcast handles,
coder ids); the work itself is in ``beam_pyspark.worker``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from typing import Any
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.utils.timestamp import Timestamp
from pyspark.accumulators import AccumulatorParam

from beam_pyspark.planning.fastpath import FastPath
from beam_pyspark.planning.plan import GroupSpec
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.spark import release
from beam_pyspark.spark.dependencies import activate as activate_dependencies
from beam_pyspark.spark.session import driver_python_path
from beam_pyspark.worker import elements
from beam_pyspark.worker.shuffle import paging
from beam_pyspark.worker import harnesses
# Registers the in-process harness's reader of bounded source splits
# (planning.reads) in every Python worker that runs a task.
from beam_pyspark.worker import reads as _harness_reads  # pylint: disable=unused-import
from beam_pyspark.worker import shuffle
from beam_pyspark.options import DEFAULT_SPLIT_AFTER_SECS
from beam_pyspark.worker.bundles import StageRunner
from beam_pyspark.worker.fastpath import FastStage
from beam_pyspark.worker.shuffle.grouping import group_values
from beam_pyspark.worker.setup.logs import capture_logs
from beam_pyspark.worker.runtime import job_runtime
from beam_pyspark.worker.runtime import use_job_options
from beam_pyspark.worker import endpoints
from beam_pyspark.worker import finalization
from beam_pyspark.worker.inputs import InputFailed
from beam_pyspark.worker import statestore
from beam_pyspark.worker import streaming
from beam_pyspark.worker.state import StoredState
from beam_pyspark.spark.keying import KeyElements  # noqa: F401
from beam_pyspark.spark.keying import KeyedSpread  # noqa: F401
from beam_pyspark.spark.keying import pack_tagged  # noqa: F401


class ListAccumulator(AccumulatorParam):
  def zero(self, value):
    return []

  def addInPlace(self, a, b):
    a.extend(b)
    return a


def driver_paths() -> list[str]:
  path = driver_python_path()
  return path.split(os.pathsep) if path else []


@dataclasses.dataclass
class TaskContext:
  job_id: str
  components: object  # Broadcast[bytes]
  metrics: object  # Accumulator[list]
  bundle_bytes: int
  python_path: list[str]
  logs: object = None  # Accumulator[list] of (time, level, text)
  log_level: int = logging.INFO
  log_overrides: Optional[dict] = None
  # The job's staged Python dependencies (spark.dependencies), if any.
  dependencies: object = None
  # The job's pipeline options (Job API form), for harnesses over gRPC.
  pipeline_options: Optional[dict] = None
  # RunnerOptions.split_stragglers_after_secs (0: never split).
  split_after_secs: float = DEFAULT_SPLIT_AFTER_SECS
  # Whether Python workers also log to their stderr: on a local master that
  # is the user's console, where the job's messages already show them.
  worker_console_logs: bool = True
  # Streaming: Accumulator[int] of bundles whose finalization waits for
  # their micro-batch's commit (worker.finalization).
  deferred: object = None
  # Batch: Accumulator[list] of the Python workers (release.worker_id)
  # where a task left something of the job's that a release stops
  # (worker.harnesses.holds).
  held: object = None

  def runtime(self):
    # Executors of a local master share the driver's file system: make the
    # user's modules (pickled by reference) importable.
    for path in self.python_path:
      if path not in sys.path:
        sys.path.append(path)
    # Before any of the job's code is unpickled: its staged dependencies,
    # and no other job's, are what this Python worker imports.
    activate_dependencies(self.dependencies, self.job_id)
    _freeze_imported_heap()
    if not self.worker_console_logs:
      _quiet_worker_console()
    return job_runtime(self.job_id, self.components.value)


def held(ctx: Optional[TaskContext]) -> Optional[set]:
  """The Python workers (release.worker_id) where a batch job's tasks left
  something a release stops; None if not known (a streaming job's)."""
  if ctx is None or ctx.held is None or ctx.deferred is not None:
    return None
  return set(ctx.held.value)


def first_attempt() -> bool:
  """Whether the running Spark task is its partition's first attempt."""
  from pyspark import TaskContext
  context = TaskContext.get()
  return context is None or context.attemptNumber() == 0


def task_attempt() -> int:
  """The running Spark task attempt's id (-1 outside a task)."""
  from pyspark import TaskContext
  context = TaskContext.get()
  return context.taskAttemptId() if context is not None else -1


_heap_frozen = False


def _freeze_imported_heap() -> None:
  """Once per Python worker, with Beam imported: ``gc.freeze()``.

  PySpark runs ``gc.collect()`` after every task, and Python's full
  collections walk every live object: with Beam's ~125k long-lived module
  objects that cost 3-6.5% of a worker's CPU (benchmarks/, docs/benchmarks.md). Frozen
  objects are skipped; they are modules and classes, alive until the worker
  exits anyway.
  """
  global _heap_frozen
  if not _heap_frozen:
    _heap_frozen = True
    import gc
    gc.freeze()


def _quiet_worker_console() -> None:
  """No logging from this Python worker straight to its stderr.

  Importing Beam gives the root logger a stderr handler (its module-level
  ``logging.warning`` about apitools runs ``basicConfig``), so on a local
  master every record a DoFn or Beam logged in an executor reached the
  user's console as well as the job's messages (through the task's log
  capture, worker.setup.logs, which stays): a failing element printed its
  traceback twice more.
  """
  root = logging.getLogger()
  for handler in list(root.handlers):
    if (type(handler) is logging.StreamHandler and  # pylint: disable=unidiomatic-typecheck
        handler.stream in (sys.stderr, sys.__stderr__)):
      root.removeHandler(handler)
  # And none again: ``logging.warning`` and friends run ``basicConfig``
  # whenever the root logger has no handler at all, so a module imported
  # later (unpickling a DoFn that imports Beam's GCP IO logs 'apitools not
  # found') would bring the console handler back for every later task.
  if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
    root.addHandler(logging.NullHandler())


def identity(x):
  return x


def consume(_):
  pass


def nothing(_) -> bool:
  """A filter that keeps nothing (an output run for its effects only)."""
  return False


def untag(record):
  return record[1]


class Tag:
  def __init__(self, tag):
    self.tag = tag

  def __call__(self, value):
    return (self.tag, value)


class HasTag:
  def __init__(self, tag):
    self.tag = tag

  def __call__(self, record):
    return record[0] == self.tag


class NotTag:
  def __init__(self, tag):
    self.tag = tag

  def __call__(self, record):
    return record[0] != self.tag


@dataclasses.dataclass(frozen=True)
class StreamWave:
  """What a stage's task needs in a streaming wave (spark.streaming): the
  node it is, the wave's clocks, and (keyed nodes) where their state lives
  and each partition's state chain before the wave (worker.statestore)."""
  node: str
  clocks: streaming.Clocks
  states: Optional[dict] = None  # partition -> chain of file names
  # The job's checkpoint location (a storage.Location).
  store_root: Any = None
  # Stages with side inputs: (transform id, tag) -> the side input's
  # watermark; main input not ready by it is held back (HELD_TAG records).
  side_watermarks: Optional[dict] = None
  # The wave's number in the job (its tasks' metric reports are told apart
  # from the same partition's in other waves by it).
  serial: int = 0
  # The micro-batch it belongs to, and the last one committed (bundles of
  # committed ones still waiting in this Python worker are finalized).
  batch: int = 0
  committed: int = -1
  # A splittable stage's limits per bundle (worker.endpoints).
  limits: Optional[endpoints.Limits] = None

  def store(self, job_id: str, partition: int) -> statestore.PartitionStore:
    return statestore.PartitionStore(
        self.store_root, job_id, self.node, partition,
        (self.states or {}).get(partition))


class RunStage:
  """mapPartitionsWithIndex: run a fused stage over one partition.

  ``group_outputs``: output transform id -> (runner-safe coder id, reduce
  partitions, compact) for outputs that feed a GroupByKey; their elements
  leave as (reduce partition, chunk of records) for the shuffle
  (worker.shuffle; compact: records of key and value bytes only).
  ``wave``: streaming only; a stateful stage then loads its partition's
  state and timers, fires only the timers due at the wave's clocks, and
  ends with a (REPORT_TAG, PartitionReport) record.
  ``fast``: batch only, the stage's chain (planning.fastpath): a task's
  first attempt runs it as a plain loop (worker.fastpath), a retry on the
  harness.
  """
  def __init__(self, ctx: TaskContext, stage: StagePlan, side, group_outputs,
               wave: Optional[StreamWave] = None,
               fast: Optional[FastPath] = None):
    self.ctx = ctx
    self.stage = stage
    self.side = side
    self.group_outputs = group_outputs
    self.wave = wave
    self.fast = fast

  def __call__(self, index: int, records: Iterable) -> Iterator:
    ctx = self.ctx
    runtime = ctx.runtime()
    use_job_options(ctx.pipeline_options)
    stage = self.stage
    attempt = task_attempt()
    # Pages left by an earlier task of this Python worker are stale now.
    paging.release(attempt, others=True)

    wave = self.wave
    # Committed metrics keep each task's last attempt: in streaming, a
    # partition's task in each wave is another task.
    name = stage.name if wave is None else f'{stage.name}@{wave.serial}'

    def report(result):
      ctx.metrics.add([(
          name, index,
          [m.SerializeToString() for m in result.monitoring_infos])])

    kept = None
    streamed = {}
    if wave is not None:
      clocks = wave.clocks
      streamed['clocks'] = (Timestamp(micros=clocks.input_watermark),
                            Timestamp(micros=clocks.processing_time))
      finalization.run_committed(ctx.job_id, wave.committed)
      streamed['defer_finalization'] = functools.partial(
          _defer, ctx, wave.batch)
      streamed['limits'] = wave.limits
      if stage.stateful:
        store = wave.store(ctx.job_id, index)
        kept = streaming.load_stage_state(runtime, stage, store)
        streamed['state_backend'] = StoredState(kept.store)
        streamed['timers'] = kept.timers

    def stage_runner(plan: StagePlan, on_finish) -> StageRunner:
      return StageRunner(
          ctx.job_id,
          runtime,
          plan,
          side_inputs=self.side.value if self.side is not None else (),
          bundle_bytes=ctx.bundle_bytes,
          on_finish=on_finish,
          pipeline_options=ctx.pipeline_options,
          split_after_secs=ctx.split_after_secs,
          **streamed)

    keyers = {}
    for transform_id, (coder_id, partitions, compact) in (
        self.group_outputs.items()):
      if compact:
        to_records = shuffle.kv_value_records
      else:
        to_records = functools.partial(
            shuffle.keyed_records, runtime.coder_impl(coder_id),
            runtime.coder(coder_id).wrapped_value_coder.key_coder().get_impl())
      keyers[transform_id] = (to_records, shuffle.PartitionPacker(partitions))
    held = None
    if wave is not None and wave.side_watermarks is not None:
      held = []
      from apache_beam.portability.api import beam_fn_api_pb2
      descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
          stage.descriptor)
      ready = streaming.side_input_gate(runtime, stage, descriptor,
                                        wave.side_watermarks)
      records = streaming.hold_back(runtime, stage, ready, records, held)
    if self.fast is not None and first_attempt():
      groups = {output_id: (partitions, compact) for output_id, (
          _, partitions, compact) in self.group_outputs.items()}
      outputs = FastStage(
          runtime, stage, self.fast, groups,
          self.side.value if self.side is not None else (),
          bundle_bytes=ctx.bundle_bytes).run(records, stage_runner, report)
    else:
      outputs = stage_runner(stage, report).run(records)
    failed = None
    with capture_logs(ctx.log_level, ctx.log_overrides) as captured:
      try:
        for transform_id, chunk in outputs:
          keyer = keyers.get(transform_id)
          if keyer is None or type(chunk) is tuple:  # pylint: disable=unidiomatic-typecheck
            # (No keyer, or records the fast path packed itself.)
            yield transform_id, chunk
          else:
            to_records, packer = keyer
            for packed in packer.add(to_records([chunk])):
              yield transform_id, packed
        for transform_id, (_, packer) in keyers.items():
          for packed in packer.flush():
            yield transform_id, packed
        if kept is not None:
          yield streaming.REPORT_TAG, streaming.save_stage_state(
              runtime, stage, wave.node, index, kept, store)
        for element in held or ():
          yield streaming.HELD_TAG, element
        if ctx.held is not None and (harnesses.holds(ctx.job_id) or
                                     finalization.pending(ctx.job_id)):
          ctx.held.add([release.worker_id()])
      except InputFailed as exn:
        # The stage feeding this one failed: the task fails with its error
        # as it raised it (worker.inputs), raised below, out of this
        # handler, so that its traceback is its own.
        harnesses.stop_all()
        failed = exn.cause
      except Exception:
        # PySpark ends this Python worker once the task has failed, with
        # os._exit: its out-of-process harnesses must end their streams now
        # (worker.harnesses.stop_all).
        harnesses.stop_all()
        raise
      finally:
        # The pages of groups this stage consumed (worker.shuffle.paging).
        paging.release(attempt)
        # A failed task's accumulator updates are dropped by Spark; its
        # error (with the user's traceback) reaches the job another way.
        if ctx.logs is not None:
          ctx.logs.add(captured.entries())
    if failed is not None:
      raise failed


def _defer(ctx: TaskContext, batch: int, harness, instruction_id: str):
  finalization.defer(ctx.job_id, batch, harness, instruction_id)
  if ctx.deferred is not None:
    ctx.deferred.add(1)


class StreamGroup:
  """Reduce side of a streaming GroupByKey (worker.streaming.group_stream):
  grouped chunks, then a (REPORT_TAG, PartitionReport) record."""
  def __init__(self, ctx: TaskContext, spec: GroupSpec, wave: StreamWave):
    self.ctx = ctx
    self.spec = spec
    self.wave = wave

  def __call__(self, index, chunks):
    wave = self.wave
    store = wave.store(self.ctx.job_id, index)
    with capture_logs(self.ctx.log_level, self.ctx.log_overrides) as captured:
      try:
        yield from streaming.group_stream(
            self.ctx.runtime(), self.spec, wave.node, index, chunks, store,
            wave.clocks)
      finally:
        if self.ctx.logs is not None:
          self.ctx.logs.add(captured.entries())


class GroupValues:
  """Reduce side of a GroupByKey, after the shuffle of record chunks.

  ``budget``: bytes of records grouped in memory before sorted runs spill
  to local disk.  ``paged``: the consuming stage runs in this same task and
  reads the group as its main input, so a large group's values may reach
  it in pages over the state API (worker.shuffle.paging).
  """
  def __init__(self, ctx: TaskContext, spec: GroupSpec, budget: int,
               paged: bool, compact: bool = False):
    self.ctx = ctx
    self.spec = spec
    self.budget = budget
    self.paged = paged
    self.compact = compact

  def __call__(self, chunks):
    return group_values(
        self.ctx.runtime(), self.spec, chunks, budget=self.budget,
        paged=self.paged, attempt=task_attempt(), compact=self.compact)


class SizedElements:
  """SDF sized restrictions -> (size, encoded element)."""
  def __init__(self, ctx: TaskContext, coder_id: str):
    self.ctx = ctx
    self.coder_id = coder_id

  def __call__(self, chunks):
    impl = self.ctx.runtime().coder_impl(self.coder_id)
    for wv in elements.decode_all(impl, chunks):
      yield float(wv.value[1]), impl.encode_nested(wv)


class SpreadElements:
  """Chunks -> (target partition, chunk), elements dealt round robin
  (``whole_chunks``: the chunks themselves, none decoded: a streaming
  read's output, in chunks of thousands, planning.readbreak).

  Deterministic (the deal starts at the partition index), so a recomputed
  task sends each element where it went the first time.
  """
  def __init__(self, ctx: TaskContext, coder_id: str, partitions: int,
               whole_chunks: bool = False):
    self.ctx = ctx
    self.coder_id = coder_id
    self.partitions = partitions
    self.whole_chunks = whole_chunks

  def __call__(self, index, chunks):
    n = self.partitions
    if self.whole_chunks:
      for i, chunk in enumerate(chunks, start=index):
        yield i % n, chunk
      return
    impl = self.ctx.runtime().coder_impl(self.coder_id)
    targets: list[list[bytes]] = [[] for _ in range(n)]
    for i, element in enumerate(
        elements.split_elements(impl, chunks), start=index):
      targets[i % n].append(element)
    for target, encoded in enumerate(targets):
      for chunk in elements.pack(encoded):
        yield target, chunk


class Transcode:
  """Split chunks into elements and re-encode them for the output buffer."""
  def __init__(self, ctx: TaskContext, in_coder_id: str, out_coder_id: str):
    self.ctx = ctx
    self.in_coder_id = in_coder_id
    self.out_coder_id = out_coder_id

  def __call__(self, chunks):
    if self.in_coder_id == self.out_coder_id:  # the same bytes again
      return chunks
    runtime = self.ctx.runtime()
    in_impl = runtime.coder_impl(self.in_coder_id)
    out_impl = runtime.coder_impl(self.out_coder_id)
    return elements.encode_stream(out_impl, elements.decode_all(in_impl, chunks))
