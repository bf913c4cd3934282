"""A streaming job's sources and the Structured Streaming query that drives
its micro-batches.

The micro-batches (``streaming.teststream.TestStreamBatch``) are what the
job's sources give at once: a TestStream's events up to its next watermark
or processing-time advance, read inline or from its TestStreamService;
for bounded sources, everything, in one.

One Structured Streaming query per job drives them (``run_query``): its
source (``MicroBatches``, a Python data source) offers one micro-batch per
trigger, by index, and its ``foreachBatch`` runs the streaming engine over
the micro-batches of each trigger. Spark keeps the query's offsets and
commits under the job's checkpoint location (``query/``), the engine its
state (``spark.checkpoints``): a query started again after a crash offers
the trigger that had not committed once more, and the engine skips the
micro-batches its own manifest says it committed. Spark's ``withWatermark``
is never used: the engine keeps Beam's watermarks itself.
"""

from __future__ import annotations

import os
from typing import Callable

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.utils.timestamp import Timestamp
from pyspark.sql.datasource import DataSource
from pyspark.sql.datasource import DataSourceStreamReader
from pyspark.sql.datasource import InputPartition

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.streaming.teststream import TestStreamBatch
from beam_pyspark.streaming.teststream import teststream_batches

# How long reading a TestStream's events from its service may take.
SERVICE_TIMEOUT_SECS = 300
SOURCE_NAME = 'beam_pyspark_microbatches'


def source_batches(plan: ExecutionPlan) -> list[TestStreamBatch]:
  """The job's micro-batches: its TestStream's (validation allows one), or
  one with everything its bounded sources hold."""
  streams = [s for s in plan.stages if s.kind == 'teststream']
  if streams:
    stream = streams[0]
    tags = sorted(set(stream.output_tags.values()))
    payload = beam_runner_api_pb2.TestStreamPayload.FromString(
        stream.read_payload)
    if payload.endpoint.url:
      return teststream_batches(
          read_test_stream_service(payload, tags), tags, unit=1)
    return teststream_batches(payload, tags)
  now = Timestamp.now().micros
  return [TestStreamBatch({}, {}, now, now, last=True)]


def read_test_stream_service(
    payload: beam_runner_api_pb2.TestStreamPayload,
    tags: list[str]) -> beam_runner_api_pb2.TestStreamPayload:
  """The TestStream's events read from its TestStreamService (Beam's
  ``TestStreamServiceController``), inline."""
  import grpc
  from apache_beam.portability.api import beam_interactive_api_pb2
  from apache_beam.portability.api import beam_interactive_api_pb2_grpc
  url = payload.endpoint.url
  inline = beam_runner_api_pb2.TestStreamPayload(coder_id=payload.coder_id)
  try:
    with grpc.insecure_channel(url) as channel:
      stub = beam_interactive_api_pb2_grpc.TestStreamServiceStub(channel)
      for event in stub.Events(
          beam_interactive_api_pb2.EventsRequest(output_ids=tags),
          timeout=SERVICE_TIMEOUT_SECS):
        inline.events.append(event)
  except grpc.RpcError as exn:
    raise PipelineExecutionError(
        f'Could not read the TestStream\'s events from its TestStreamService '
        f'at {url}: {exn.code().name}: {exn.details()}. Is the service '
        'still running, and reachable from the job server?') from exn
  return inline


# -- the query ----------------------------------------------------------------


class _MicroBatchReader(DataSourceStreamReader):
  """Offsets are micro-batch indices; one new micro-batch per trigger."""
  def __init__(self, count: int):
    self.count = count

  def initialOffset(self) -> dict:
    return {'batch': -1}

  def latestOffset(self, start=None, limit=None) -> dict:
    last = self.count - 1
    if start is None:
      return {'batch': last}
    return {'batch': min(start['batch'] + 1, last)}

  def partitions(self, start: dict, end: dict):
    return [InputPartition(i)
            for i in range(start['batch'] + 1, end['batch'] + 1)]

  def read(self, partition):
    yield (partition.value,)

  def commit(self, end: dict) -> None:
    pass


class MicroBatches(DataSource):
  """The micro-batch indices of a job, ``count`` of them (an option)."""
  @classmethod
  def name(cls) -> str:
    return SOURCE_NAME

  def schema(self) -> str:
    return 'batch int'

  def streamReader(self, schema):
    return _MicroBatchReader(int(self.options['count']))


class Query:
  """A job's query: runs ``run_batch(index)`` for each micro-batch, in
  order, on a thread of Spark's, and waits for the last. A batch that
  raises (a cancelled job's does) ends the query: stopping a query while
  its foreachBatch runs can kill Spark's stream thread (DESIGN.md, traps),
  so ``stop()`` is called only once it is idle or over."""
  def __init__(self, sc, job_id: str, count: int, location: str,
               run_batch: Callable[[int], None]):
    self.sc, self.job_id, self.count = sc, job_id, count
    self.location = os.path.join(location, 'query')
    self.run_batch = run_batch
    self._errors: list[BaseException] = []

  def run(self) -> None:
    if self.count == 0:
      return
    from pyspark.sql import SparkSession
    spark = SparkSession(self.sc)
    spark.dataSource.register(MicroBatches)
    query = (
        spark.readStream.format(SOURCE_NAME)
        .option('count', str(self.count)).load()
        .writeStream.queryName(f'beam-{self.job_id}')
        .foreachBatch(self._each)
        .option('checkpointLocation', self.location).start())
    try:
      query.processAllAvailable()
    except Exception:  # pylint: disable=broad-except
      if not self._errors:
        raise
    finally:
      # Idle (every batch done) or over (one failed) by now.
      try:
        query.stop()
      except Exception:  # pylint: disable=broad-except
        pass
    if self._errors:
      # The engine's own error (a user's traceback), not Spark's wrapping.
      raise self._errors[0]

  def _each(self, frame, _batch_id) -> None:
    if self._errors:
      return
    try:
      # foreachBatch runs on a thread of its own: the job's Spark jobs
      # belong to its group there too (Cancel).
      self.sc.setJobGroup(self.job_id, f'Beam job {self.job_id}', True)
      for index in sorted(row.batch for row in frame.collect()):
        self.run_batch(index)
    except BaseException as exn:  # pylint: disable=broad-except
      self._errors.append(exn)
      raise
