"""An ExecutionPlan's stages as DataFrames over Spark Connect.

The same buffers as the RDD engine's (``spark.translate``), as DataFrames
of ``connect.tasks.ROWS``:

* impulse        -> a one-row DataFrame of the encoded impulse
* materialize    -> the producers' output rows of that tag; several -> union
* group          -> producers pack (key, element) records per reduce
                    partition (the RDD engine's chunk packing), then
                    ``repartition(n, 'part')`` and ``mapInArrow`` of the
                    reduce side (connect.tasks.ArrowGroup)
* reshuffle      -> elements dealt over partitions, repartitioned; SDF
                    restrictions packed by size, largest first
* stateful stage -> one row per element, repartitioned by encoded key
* side input     -> collected by the client, turned into state entries,
                    handed to the consuming stage's tasks in their closure
* read           -> the source split by the client, a small DataFrame of
                    splits

A stage is one ``mapInArrow`` (connect.tasks.ArrowStage) over the union of
its inputs, each re-tagged with the transform id that reads it.
"""

from __future__ import annotations

import collections
import pickle

from apache_beam.runners.common import ENCODED_IMPULSE_VALUE
from apache_beam.runners.portability.fn_api_runner import translations as tr
from apache_beam.transforms.window import GlobalWindows

from beam_pyspark.connect import tasks
from beam_pyspark.connect.partitions import targets
from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.spark.partitioning import pack_by_size
from beam_pyspark.spark.reads import _weights
from beam_pyspark.spark.reads import split_source
from beam_pyspark.worker import elements
from beam_pyspark.worker.shuffle import is_global_bytes_kv
from beam_pyspark.worker.state import side_input_entries


# A collected row of ROWS.
Row = collections.namedtuple('Row', 'tag part data')


def _functions():
  from pyspark.sql.connect import functions
  return functions


def known(df):
  """``df``, told that its schema is ROWS (every DataFrame of the engine's
  is): Connect's client would ask the server (``mapInArrow`` reads its
  input's columns, ``toArrow`` its schema)."""
  if getattr(df, '_cached_schema', False) is None:
    df._cached_schema = tasks.rows_type()  # pylint: disable=protected-access
  return df


def map_in_arrow(df, function):
  """``df.mapInArrow(function)`` to ROWS, with no schema round trip."""
  return known(df).mapInArrow(function, tasks.rows_type())


def collect_rows(df) -> list:
  """``df``'s rows as ``Row`` tuples, through Arrow (``collect`` asks the
  server a setting first, then makes a pyspark Row per row)."""
  table = known(df).toArrow()
  return [Row(*r) for r in zip(*(table.column(name).to_pylist()
                                  for name in Row._fields))]


class StageTranslator:
  """The stages of ``self.plan`` as DataFrames on ``self.spark``
  (mixed into connect.engine.ConnectPipelineJob, which owns the job's
  actions, reports and lifecycle)."""

  def _translate(self, stage: StagePlan):
    if stage.kind == 'reshuffle':
      return self._reshuffle(stage)
    if stage.kind == 'read':
      return self._read(stage)
    return self._sdk_stage(stage)

  def _rows(self, rows: list):
    return known(self.spark.createDataFrame(rows, tasks.rows_type()))

  def _partitioned(self, tag: str, chunks: list[bytes]):
    """One row of ``tag`` per chunk, chunk ``i`` alone in partition ``i``:
    ``range``'s partitions pick literals (no Python, no shuffle)."""
    if not chunks:
      return self._rows([])
    f = _functions()
    n = len(chunks)
    data = f.element_at(f.array(*[f.lit(bytes(c)) for c in chunks]),
                        (f.col('id') + 1).cast('int'))
    return known(self.spark.range(0, n, 1, n).select(
        f.lit(tag).alias('tag'), f.lit(None).cast('int').alias('part'),
        data.alias('data')))

  def _retag(self, df, tag: str):
    """A buffer's rows as the input ``tag`` of a stage; REPORT rows kept."""
    f = _functions()
    return df.withColumn(
        'tag', f.when(f.col('tag') == tasks.REPORT, f.lit(tasks.REPORT))
        .otherwise(f.lit(tag)))

  def _union(self, frames: list):
    if not frames:
      return self._rows([])
    out = frames[0]
    for df in frames[1:]:
      out = out.unionAll(df)
    return out

  def _sdk_stage(self, stage: StagePlan):
    inputs, keyed = [], []
    group = self._fused_group(stage)
    for transform_id, buffer_id in stage.inputs.items():
      if group is not None:
        inputs.append(self._shuffled(buffer_id))
        break
      df = self._buffer(buffer_id)
      if stage.stateful and buffer_id != IMPULSE_BUFFER:
        keyed.append(map_in_arrow(df, tasks.ArrowKey(
            self._ctx, stage.input_coders[transform_id], transform_id,
            self._parallelism)))
      else:
        inputs.append(self._retag(df, transform_id))
    if keyed:
      inputs.append(self._union(keyed).repartition(self._parallelism, 'part'))
    side = None
    if stage.side_inputs:
      side = tasks.Value([
          side_input_entries(self._runtime, spec, self._collect(spec.buffer_id))
          for spec in stage.side_inputs])
    group_outputs = {
        transform_id: (stage.output_coders[transform_id], self._parallelism,
                       self._compact(buffer_id))
        for transform_id, buffer_id in stage.outputs.items()
        if tr.split_buffer_id(buffer_id)[0] == 'group'
    }
    run = tasks.ArrowStage(self._ctx, stage, side, group_outputs,
                           fast=self._fast.get(stage.name),
                           keyed=bool(keyed), group=group)
    out = map_in_arrow(self._union(inputs), run)
    self._register_outputs(stage, out)
    return out

  def _reshuffle(self, stage: StagePlan):
    (in_id, buffer_id), = stage.inputs.items()
    source = self._buffer(buffer_id)
    if not stage.outputs:
      return source
    (out_id, _), = stage.outputs.items()
    n = self._parallelism
    if stage.sized:
      rows = self._action(
          lambda: collect_rows(map_in_arrow(source, tasks.ArrowSized(
              self._ctx, stage.input_coders[in_id]))),
          'the sizes of restrictions to pack')
      sized = [(float(r.tag), r.data) for r in self._reports_from(rows)]
      bins = pack_by_size([s for s, _ in sized], n)
      self.log(f'{stage.name}: {len(sized)} restrictions packed into '
               f'{len(bins)} partitions by size')
      to = targets(n)
      spread = self._rows([('', to[b], sized[i][1])
                           for b, members in enumerate(bins) for i in members])
    elif stage.keeps_keys:  # a key's elements in one partition
      spread = map_in_arrow(source, tasks.ArrowKey(
          self._ctx, stage.input_coders[in_id], in_id, n))
    else:
      spread = map_in_arrow(source, tasks.ArrowSpread(
          self._ctx, stage.input_coders[in_id], n))
    out = map_in_arrow(spread.repartition(n, 'part'), tasks.ArrowTranscode(
        self._ctx, stage.input_coders[in_id], stage.output_coders[out_id],
        out_id))
    self._register_outputs(stage, out)
    return out

  def _read(self, stage: StagePlan):
    """A bounded source split by the client: one element per split."""
    n = self._parallelism
    try:
      estimated, desired, splits = split_source(stage.read_payload, n)
    except Exception as exn:  # pylint: disable=broad-except
      self.log(f'{stage.name}: the client could not split the source '
               f'({type(exn).__name__}: {exn}); splitting it in an executor')
      rows = self._action(lambda: collect_rows(map_in_arrow(
          self._rows([('', None, b'')]),
          tasks.ArrowSplit(self._ctx, stage.read_payload, n))),
                          'splitting a source')
      estimated, desired, splits = pickle.loads(
          self._reports_from(rows)[0].data)
    (out_id, _), = stage.outputs.items()
    impl = self._runtime.coder_impl(stage.output_coders[out_id])
    encoded = [
        b''.join(elements.encode_stream(
            impl, [GlobalWindows.windowed_value(split)]))
        for _, split in splits]
    bins = pack_by_size(_weights([w for w, _ in splits]), n)
    size = 'unknown' if estimated is None else f'{estimated}'
    self.log(f'{stage.name}: {len(splits)} splits of the source (desired '
             f'{desired} bytes each, estimated size {size} bytes), packed '
             f'into {len(bins)} partitions by weight')
    # A bin's splits as one chunk, in a partition of its own (as the RDD
    # engine's parallelize of the bins).
    out = self._partitioned(
        out_id, [b''.join(encoded[i] for i in members) for members in bins])
    self._register_outputs(stage, out)
    return out

  def _register_outputs(self, stage: StagePlan, out) -> None:
    if self._computations(stage) > 1:
      out = out.persist()
      self._persisted.append(out)
    f = _functions()
    for transform_id, buffer_id in stage.outputs.items():
      self._producer_frames.setdefault(buffer_id, []).append(
          out.filter(f.col('tag').isin(transform_id, tasks.REPORT)))

  def _computations(self, stage: StagePlan) -> int:
    """How many times the job's actions would compute ``stage``'s
    DataFrame: once per input of a stage reading one of its outputs, once
    for an output read as a side input (collected once, kept by the
    client). More than once: it is persisted."""
    total = 0
    for buffer_id in set(stage.outputs.values()):
      total += sum(
          1 for consumer in self._consumers.get(buffer_id, ())
          for read in consumer.inputs.values() if read == buffer_id)
      total += buffer_id in self._side_buffer_ids
    return total

  def _fused_group(self, stage: StagePlan):
    """For a stage that is the one reader of a GroupByKey and reads
    nothing else: what its tasks group before they run it (ArrowStage's
    ``group``). Else None: the group is a DataFrame of its own."""
    if stage.stateful or len(stage.inputs) != 1:
      return None
    (transform_id, buffer_id), = stage.inputs.items()
    if (buffer_id not in self.plan.groups or
        buffer_id in self._side_buffer_ids or
        len(self._consumers.get(buffer_id, ())) != 1):
      return None
    return (transform_id, self.plan.groups[buffer_id], self._group_budget,
            bool(stage.state_backed_iterables), self._compact(buffer_id))

  def _shuffled(self, buffer_id: bytes):
    """A GroupByKey's producers' record chunks, each in the reduce
    partition it was packed for."""
    producers = self._producer_frames.get(buffer_id, [])
    if not producers and buffer_id in self._producers:
      raise RuntimeError(
          f'buffer {buffer_id!r} is read before the stage that writes '
          'it was translated: the plan is not in producer order')
    return self._union(producers).repartition(self._parallelism, 'part')

  # -- buffers --------------------------------------------------------------

  def _buffer(self, buffer_id: bytes):
    df = self._buffer_frames.get(buffer_id)
    if df is not None:
      return df
    if buffer_id == IMPULSE_BUFFER:
      df = self._rows([('', None, ENCODED_IMPULSE_VALUE)])
    elif tr.split_buffer_id(buffer_id)[0] == 'group':
      df = map_in_arrow(self._shuffled(buffer_id), tasks.ArrowGroup(
          self._ctx, self.plan.groups[buffer_id], self._group_budget,
          self._compact(buffer_id)))
    else:
      producers = self._producer_frames.get(buffer_id, [])
      if not producers and buffer_id in self._producers:
        raise RuntimeError(
            f'buffer {buffer_id!r} is read before the stage that writes '
            'it was translated: the plan is not in producer order')
      df = self._union(producers)
    self._buffer_frames[buffer_id] = df
    return df

  def _compact(self, buffer_id: bytes) -> bool:
    spec = self.plan.groups[buffer_id]
    return spec.default_windowing and is_global_bytes_kv(
        self._runtime.coder(spec.safe_input_coder_id))

  def _collect(self, buffer_id: bytes) -> list[bytes]:
    chunks = self._side_chunks.get(buffer_id)
    if chunks is None:
      df = self._buffer(buffer_id)
      rows = self._action(lambda: collect_rows(df), 'a side input')
      chunks = self._side_chunks[buffer_id] = [
          r.data for r in self._reports_from(rows)]
    return chunks
