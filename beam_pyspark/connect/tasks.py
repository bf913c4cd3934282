"""What the Connect engine's ``mapInArrow`` calls run inside executors.

Every DataFrame of the engine has one schema, ``ROWS``: a tag (the input
or output transform id a chunk belongs to, or ``REPORT``), a partition
value (``part``: where ``repartition(n, 'part')`` sends the row, see
``connect.partitions``; null when no shuffle follows) and the bytes (a
chunk of encoded elements, as the RDD engine's buffers hold).

Each function wraps the RDD engine's own task code (``spark.tasks``: the
fused stage's harness and fast path, the reduce side of a GroupByKey,
keying, spreading and transcoding): the Arrow batches become the
iterators of (tag, bytes) those read, and what they yield becomes Arrow
batches again. What the RDD engine sends back through accumulators (a
task's metric reports and captured logs) leaves as ``REPORT`` rows,
which every later step passes on unchanged, so that the client collects
them with the job's last action (``connect.engine``).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Iterable
from typing import Iterator
from typing import Optional

from beam_pyspark.connect.partitions import targets

ROWS = 'tag string, part int, data binary'
REPORT = '\x00report'
_ROWS_TYPE = None
# Bytes of chunks per Arrow batch a task yields: about one ~1 MiB chunk,
# so that the JVM takes in one batch while the task's Python makes the
# next (as batches reach Python: connect.engine.SESSION_CONF).
BATCH_BYTES = 1 << 20


def rows_type():
  """ROWS as a StructType: given to ``mapInArrow`` and told to every
  DataFrame of the engine, so that Connect's client asks the server for
  no schema (a DDL string is parsed there, and ``mapInArrow`` reads its
  input's columns: an analysis round trip each, per stage)."""
  global _ROWS_TYPE
  if _ROWS_TYPE is None:
    from pyspark.sql.types import BinaryType
    from pyspark.sql.types import IntegerType
    from pyspark.sql.types import StringType
    from pyspark.sql.types import StructField
    from pyspark.sql.types import StructType
    _ROWS_TYPE = StructType([StructField('tag', StringType()),
                             StructField('part', IntegerType()),
                             StructField('data', BinaryType())])
  return _ROWS_TYPE


class Value:
  """A value shipped in the task's closure, read as a broadcast is."""
  def __init__(self, value):
    self.value = value


class Collector:
  """An accumulator's ``add`` within one task: kept, sent as REPORT rows."""
  def __init__(self):
    self.value: list = []

  def add(self, items) -> None:
    self.value.extend(items)


@dataclasses.dataclass
class ConnectTaskContext:
  """Plain data every task is handed (spark.tasks.TaskContext without
  Spark's broadcasts and accumulators, which Connect has not)."""
  job_id: str
  components: bytes
  bundle_bytes: int
  python_path: list
  log_level: int = logging.INFO
  log_overrides: Optional[dict] = None
  pipeline_options: Optional[dict] = None
  split_after_secs: float = 0.0
  worker_console_logs: bool = True
  # The job's staged dependencies, served by the client (spark.dependencies).
  dependencies: object = None

  def task_context(self):
    """The RDD engine's TaskContext, over this task's collectors."""
    from beam_pyspark.spark import tasks
    return tasks.TaskContext(
        job_id=self.job_id,
        components=Value(self.components),
        metrics=Collector(),
        bundle_bytes=self.bundle_bytes,
        python_path=self.python_path,
        logs=Collector(),
        log_level=self.log_level,
        log_overrides=self.log_overrides,
        pipeline_options=self.pipeline_options,
        split_after_secs=self.split_after_secs,
        worker_console_logs=self.worker_console_logs,
        dependencies=self.dependencies)


def partition_index() -> int:
  from pyspark import TaskContext
  context = TaskContext.get()
  return context.partitionId() if context is not None else 0


def report_rows(ctx) -> Iterator[tuple]:
  """The task's metric reports and logs as REPORT rows (each carries the
  task attempt, so that the client drops a copy read twice)."""
  from beam_pyspark.spark.tasks import task_attempt
  attempt = task_attempt()
  if ctx.metrics.value:
    yield REPORT, None, pickle.dumps(('metrics', attempt, ctx.metrics.value))
  if ctx.logs is not None and ctx.logs.value:
    yield REPORT, None, pickle.dumps(('logs', attempt, ctx.logs.value))


def batches(rows: Iterable[tuple]) -> Iterator:
  """(tag, part, data) rows as Arrow batches of about BATCH_BYTES."""
  import pyarrow as pa
  tags, parts, data = [], [], []
  size = 0
  for tag, part, chunk in rows:
    tags.append(tag)
    parts.append(part)
    data.append(chunk)
    size += len(chunk)
    if size >= BATCH_BYTES:
      yield _batch(pa, tags, parts, data)
      tags, parts, data = [], [], []
      size = 0
  if tags:
    yield _batch(pa, tags, parts, data)


_SCHEMA = None


def _batch(pa, tags, parts, data):
  global _SCHEMA
  if _SCHEMA is None:
    _SCHEMA = pa.schema([('tag', pa.string()), ('part', pa.int32()),
                         ('data', pa.binary())])
  return pa.RecordBatch.from_arrays(
      [pa.array(tags, pa.string()), pa.array(parts, pa.int32()),
       pa.array(data, pa.binary())], schema=_SCHEMA)


def read_rows(arrow_batches, passed: list) -> Iterator[tuple[str, bytes]]:
  """(tag, data) of the input's rows; REPORT rows go to ``passed``."""
  for batch in arrow_batches:
    tags = batch.column(0).to_pylist()
    data = batch.column(2).to_pylist()
    for tag, chunk in zip(tags, data):
      if tag == REPORT:
        passed.append((REPORT, None, chunk))
      else:
        yield tag, chunk


def _with_parts(outputs, groups: dict) -> Iterator[tuple]:
  """(tag, chunk or (partition, chunk)) -> rows; a group output's
  partition becomes the value that lands there (connect.partitions)."""
  for tag, chunk in outputs:
    if type(chunk) is tuple:  # pylint: disable=unidiomatic-typecheck
      partition, chunk = chunk
      yield tag, targets(groups[tag])[partition], chunk
    else:
      yield tag, None, chunk


class ArrowStage:
  """A fused stage over one partition: spark.tasks.RunStage (the harness,
  or the fast path on a first attempt) between Arrow batches.

  ``keyed``: the input's rows are single elements a stateful stage reads
  (``ArrowKey``), packed into chunks per input here.
  ``group``: (input transform id, GroupSpec, budget, paged, compact): the
  input's rows are a GroupByKey's shuffled record chunks, grouped here
  first (spark.tasks.GroupValues), in the task that consumes them as the
  RDD engine's reduce side and stage share a task: no hop through the
  JVM between them, and a large group's values may be paged.
  """
  def __init__(self, ctx: ConnectTaskContext, stage, side, group_outputs,
               fast=None, keyed: bool = False, group=None):
    self.ctx = ctx
    self.stage = stage
    self.side = side
    self.group_outputs = group_outputs
    self.fast = fast
    self.keyed = keyed
    self.group = group

  def __call__(self, arrow_batches):
    from beam_pyspark.spark import tasks
    ctx = self.ctx.task_context()
    passed: list = []
    records = read_rows(arrow_batches, passed)
    if self.keyed:
      records = _packed(records)
    if self.group is not None:
      tag, spec, budget, paged, compact = self.group
      chunks = (chunk for _, chunk in records)
      records = ((tag, chunk) for chunk in tasks.GroupValues(
          ctx, spec, budget, paged, compact)(chunks))
    run = tasks.RunStage(ctx, self.stage, self.side, self.group_outputs,
                         fast=self.fast)
    groups = {t: parts for t, (_, parts, _) in self.group_outputs.items()}
    outputs = run(partition_index(), records)
    yield from batches(_chain(_with_parts(outputs, groups), passed,
                              report_rows, ctx))


def _chain(rows, passed: list, reports, ctx) -> Iterator[tuple]:
  yield from rows
  yield from passed
  yield from reports(ctx)


def _packed(records) -> Iterator[tuple[str, bytes]]:
  """Single elements, consecutive ones of one input packed into chunks."""
  from beam_pyspark.worker import elements
  tag, run = None, []
  for record_tag, element in records:
    if record_tag != tag and run:
      for chunk in elements.pack(run):
        yield tag, chunk
      run = []
    tag = record_tag
    run.append(element)
  if run:
    for chunk in elements.pack(run):
      yield tag, chunk


class ArrowGroup:
  """The reduce side of a GroupByKey (spark.tasks.GroupValues), after
  ``repartition(n, 'part')`` of the producers' packed record chunks."""
  def __init__(self, ctx: ConnectTaskContext, spec, budget: int,
               compact: bool):
    self.ctx = ctx
    self.spec = spec
    self.budget = budget
    self.compact = compact

  def __call__(self, arrow_batches):
    from beam_pyspark.spark import tasks
    ctx = self.ctx.task_context()
    passed: list = []
    chunks = (chunk for _, chunk in read_rows(arrow_batches, passed))
    grouped = tasks.GroupValues(ctx, self.spec, self.budget, False,
                                self.compact)(chunks)
    rows = (('', None, chunk) for chunk in grouped)
    yield from batches(_chain(rows, passed, report_rows, ctx))


class ArrowKey:
  """KV chunks -> one row per element, its part from its encoded key
  (crc32, as the RDD engine's stable_hash): a stateful stage's input."""
  def __init__(self, ctx: ConnectTaskContext, coder_id: str,
               transform_id: str, partitions: int):
    self.ctx = ctx
    self.coder_id = coder_id
    self.transform_id = transform_id
    self.partitions = partitions

  def __call__(self, arrow_batches):
    from beam_pyspark.spark import tasks
    from beam_pyspark.spark.partitioning import stable_hash
    ctx = self.ctx.task_context()
    passed: list = []
    chunks = (chunk for _, chunk in read_rows(arrow_batches, passed))
    to = targets(self.partitions)
    n = self.partitions
    rows = ((tag, to[stable_hash(key) % n], element)
            for key, (tag, element) in tasks.KeyElements(
                ctx, self.coder_id, self.transform_id)(chunks))
    yield from batches(_chain(rows, passed, report_rows, ctx))


class ArrowSpread:
  """A reshuffle's map side (spark.tasks.SpreadElements)."""
  def __init__(self, ctx: ConnectTaskContext, coder_id: str, partitions: int):
    self.ctx = ctx
    self.coder_id = coder_id
    self.partitions = partitions

  def __call__(self, arrow_batches):
    from beam_pyspark.spark import tasks
    ctx = self.ctx.task_context()
    passed: list = []
    chunks = (chunk for _, chunk in read_rows(arrow_batches, passed))
    to = targets(self.partitions)
    spread = tasks.SpreadElements(ctx, self.coder_id, self.partitions)
    rows = (('', to[target], chunk)
            for target, chunk in spread(partition_index(), chunks))
    yield from batches(_chain(rows, passed, report_rows, ctx))


class ArrowTranscode:
  """Chunks re-encoded for a reshuffle's output (spark.tasks.Transcode)."""
  def __init__(self, ctx: ConnectTaskContext, in_coder_id: str,
               out_coder_id: str, tag: str):
    self.ctx = ctx
    self.in_coder_id = in_coder_id
    self.out_coder_id = out_coder_id
    self.tag = tag

  def __call__(self, arrow_batches):
    from beam_pyspark.spark import tasks
    ctx = self.ctx.task_context()
    passed: list = []
    chunks = (chunk for _, chunk in read_rows(arrow_batches, passed))
    out = tasks.Transcode(ctx, self.in_coder_id, self.out_coder_id)(chunks)
    rows = ((self.tag, None, chunk) for chunk in out)
    yield from batches(_chain(rows, passed, report_rows, ctx))


class ArrowSized:
  """SDF sized restrictions -> rows of (its size as text, element)."""
  def __init__(self, ctx: ConnectTaskContext, coder_id: str):
    self.ctx = ctx
    self.coder_id = coder_id

  def __call__(self, arrow_batches):
    from beam_pyspark.spark import tasks
    ctx = self.ctx.task_context()
    passed: list = []
    chunks = (chunk for _, chunk in read_rows(arrow_batches, passed))
    sized = tasks.SizedElements(ctx, self.coder_id)(chunks)
    rows = ((repr(size), None, element) for size, element in sized)
    yield from batches(_chain(rows, passed, report_rows, ctx))


class ArrowSplit:
  """A bounded source split in an executor (spark.reads.SplitInTask): one
  row of the pickled (estimate, desired bytes, splits)."""
  def __init__(self, ctx: ConnectTaskContext, read_payload: bytes,
               parallelism: int):
    self.ctx = ctx
    self.read_payload = read_payload
    self.parallelism = parallelism

  def __call__(self, arrow_batches):
    from beam_pyspark.spark.reads import split_source
    for _ in arrow_batches:
      pass
    self.ctx.task_context().runtime()
    result = split_source(self.read_payload, self.parallelism)
    yield from batches([('', None, pickle.dumps(result))])


class ArrowRelease:
  """Stops the job's harnesses in this Python worker (spark.release)."""
  def __init__(self, job_id: str, succeeded: bool):
    self.job_id = job_id
    self.succeeded = succeeded

  def __call__(self, arrow_batches):
    from beam_pyspark.spark.release import ReleaseJob
    for _ in arrow_batches:
      pass
    ReleaseJob(self.job_id, self.succeeded).release()
    return iter(())
