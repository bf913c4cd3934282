"""A streaming job's sources and the Structured Streaming query that drives
its micro-batches.

One Structured Streaming query per job (``Query``): its source
(``MicroBatches``, a Python data source) is the streaming client of the
design documents. At each trigger it reads the engine's latest committed
offer (its endpoints: the live restrictions of the job's splittable reads)
and offers the next micro-batch when there is something to do, granting
the trigger's record budget evenly over the endpoints ready to run
(``streaming.endpoints``); a TestStream's events come one micro-batch per
trigger too (``source_batches``). The query's ``foreachBatch`` runs the
streaming engine over each. Spark keeps the query's offsets (with the
grants and the trigger's time) and commits under the job's checkpoint
location (``query/``), the engine its state (``spark.checkpoints``): a
query started again after a crash offers the trigger that had not
committed once more, with the same grants, and the engine skips
micro-batches its own manifest says it committed. Spark's
``withWatermark`` is never used: the engine keeps Beam's watermarks.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import posixpath
import threading
import time
from typing import Callable
from typing import Optional

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.utils.timestamp import Timestamp

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.options import MAX_BUDGET_SCALE
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.spark.microbatches import DRAIN_MARKER
from beam_pyspark.spark.microbatches import SOURCE_NAME
from beam_pyspark.spark.microbatches import STOP_MARKER
from beam_pyspark.spark.microbatches import _STORAGE_PREFIX
from beam_pyspark.spark.microbatches import MicroBatches
from beam_pyspark.spark.microbatches import _MicroBatchReader  # noqa: F401 (tests)
from beam_pyspark.spark.microbatches import _remove
from beam_pyspark.spark.microbatches import _touch
from beam_pyspark.spark.microbatches import control_dir
from beam_pyspark.spark.microbatches import request_drain  # noqa: F401
from beam_pyspark.spark import querystarts
from beam_pyspark.storage import Location
from beam_pyspark.streaming.teststream import TestStreamBatch
from beam_pyspark.streaming.teststream import teststream_batches

# How long reading a TestStream's events from its service may take.
SERVICE_TIMEOUT_SECS = 300
_LOGGER = logging.getLogger(__name__)


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
  return [TestStreamBatch((), {}, now, now, last=True)]


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


def teststream_outputs(sc, ctx, stage: StagePlan,
                       elements: dict[str, list]) -> list:
  """One event's elements of a TestStream (output tag -> [(timestamp,
  encoded element)]): (output id, RDD of (output id, chunk)) for each
  output with elements in it."""
  from beam_pyspark.spark import tasks  # pylint: disable=import-outside-toplevel
  from beam_pyspark.worker import streaming as worker_streaming  # pylint: disable=import-outside-toplevel
  payload = beam_runner_api_pb2.TestStreamPayload.FromString(
      stage.read_payload)
  outs = []
  for out_id, tag in stage.output_tags.items():
    events = elements.get(tag)
    if events:
      outs.append((out_id, sc.parallelize(events, 1).mapPartitions(
          worker_streaming.TestStreamElements(ctx, payload.coder_id,
                                              stage.element_coders[out_id],
                                              stage.output_coders[out_id],
                                              stage.nested_elements))
                   .map(tasks.Tag(out_id))))
  return outs


# -- the query ----------------------------------------------------------------

def micro_batch(batches: list[TestStreamBatch], index: int, trigger_time: int,
                now: int, teststream: bool,
                draining: bool) -> TestStreamBatch:
  """Micro-batch ``index``: the TestStream's, or (none left, or draining)
  one of no events, whose processing time is the trigger's (durable in
  Spark's offset log) or, with a TestStream, its last."""
  if index < len(batches) and not draining:
    return batches[index]
  at = now if teststream else max(now, trigger_time)
  return TestStreamBatch((), {}, at, at)


def source_options(options, teststream_batches: int,
                   teststream: bool) -> dict:
  """The query source's options (``MicroBatches``) for a job."""
  return {
      'teststream': teststream_batches,
      # Processing time is the TestStream's, else the wall clock's.
      'wall_clock': 'false' if teststream else 'true',
      'budget': options.records_per_batch or 0,
      'budget_scale': MAX_BUDGET_SCALE if options.adaptive_budget else 1,
      'byte_budget': options.bytes_per_batch or 0,
  }


def streaming_session(sc):
  """Spark's SQL session on ``sc``, the micro-batch source registered.

  The first in a process costs seconds (Spark's SQL machinery starts:
  SparkSession 4.9 s, register 3.2 s, the source's first load 3.4 s at
  load 7; 0.1-0.3 s each after), which is why ``warm_up`` exists."""
  from pyspark.sql import SparkSession
  spark = SparkSession(sc)
  spark.dataSource.register(MicroBatches)
  return spark


def start_python_workers(sc, label: str) -> None:
  """One task per slot doing nothing: Spark's Python workers start (their
  daemon imports Beam) before a job's first tasks need them."""
  from beam_pyspark.spark import naming  # pylint: disable=import-outside-toplevel
  from beam_pyspark.spark import tasks  # pylint: disable=import-outside-toplevel
  slots = max(1, sc.defaultParallelism)
  with naming.call_site(sc, f'{label}: start its Python workers'):
    sc.parallelize(range(slots), slots).foreach(tasks.nothing)


def warm_up(sc, timeout: float = 120) -> None:
  """What a process's first streaming job would otherwise wait for, done
  ahead (the job server does it at start): Spark's SQL session, the
  micro-batch source registered, and one throwaway query of it run to the
  end of its first micro-batch (Spark's streaming machinery, the source's
  Python processes, the read of a micro-batch in a Python worker), in a
  temporary directory; then the Python workers. A job server's first
  streaming job went live 12.6 s after "Running job" without a warm-up,
  5.4 s with the session and source alone, 2.1 s with this query too
  (load 3-5, benchmarks/streaming_startup.py --job-server)."""
  import tempfile  # pylint: disable=import-outside-toplevel
  spark = streaming_session(sc)
  ran = threading.Event()

  def each(frame, _):
    frame.collect()
    ran.set()

  with tempfile.TemporaryDirectory(prefix='beam-pyspark-warm-up-') as tmp:
    os.makedirs(os.path.join(tmp, 'manifests'))
    # The source offers micro-batch 0 of a location with no commit, then,
    # told to stop, nothing more.
    _touch(os.path.join(tmp, STOP_MARKER))
    query = (spark.readStream.format(SOURCE_NAME).option('location', tmp)
             .option('control', tmp).load().writeStream
             .queryName('beam-pyspark-warm-up').foreachBatch(each)
             .option('checkpointLocation', os.path.join(tmp, 'query'))
             .start())
    try:
      deadline = time.monotonic() + timeout
      while (query.isActive and time.monotonic() < deadline and
             (not ran.is_set() or query.status['isTriggerActive'])):
        query.awaitTermination(0.1)
    finally:
      # Idle (its batch ran) or over: stopping it cannot catch a
      # foreachBatch running (DESIGN.md, traps).
      query.stop()
  _LOGGER.debug('Warm-up query: its micro-batch %s',
                'ran' if ran.is_set() else 'did not run')
  start_python_workers(sc, 'Warm-up')


def warm_up_spark(master: str, conf: Optional[dict] = None) -> None:
  """engine.WARM_UP: Spark for ``master`` started, then ``warm_up``."""
  from beam_pyspark.spark.session import spark_context  # pylint: disable=import-outside-toplevel
  warm_up(spark_context(master, conf))


@dataclasses.dataclass(frozen=True)
class Trigger:
  """One micro-batch as the source offered it."""
  batch: int
  time: int  # wall-clock micros the trigger was decided at
  grants: dict  # endpoint id -> records (None: no limit)


class Query:
  """A job's query: runs ``run_batch(Trigger)`` for each micro-batch, in
  order, on a thread of Spark's, until ``finished()`` or ``stopping()``
  (cancel) says so, and the query is idle. A batch that raises (a
  cancelled job's does) ends the query: stopping a query while its
  foreachBatch runs can kill Spark's stream thread (DESIGN.md, traps), so
  ``stop()`` is called only once it is idle or over."""
  def __init__(self, sc, job_id: str, location: Location,
               run_batch: Callable[[Trigger], None],
               finished: Callable[[], bool], stopping: Callable[[], bool],
               options: dict, log: Callable[[str], None] = lambda _: None):
    self.sc, self.job_id = sc, job_id
    self.checkpoint = location
    self.root = control_dir(location)
    # Spark's own checkpoint: under the location where its JVM can write
    # there, else on the driver's disk (why is logged).
    self.location, why = location.query_checkpoint()
    self._local_query = location.local is not None or why is not None
    if why:
      log(why)
    self.run_batch = run_batch
    self.finished, self.stopping = finished, stopping
    self.options = options
    self.log = log
    self._errors: list[BaseException] = []
    self._started: Optional[float] = None  # until the first micro-batch
    self._warming: Optional[threading.Thread] = None
    self._starting = True

  @property
  def starting(self) -> bool:
    """Whether Spark has yet to offer the query's first micro-batch."""
    return self._starting

  def run(self) -> None:
    _remove(os.path.join(self.root, STOP_MARKER))
    # Starting the query takes seconds of its own (a session, Python
    # processes of Spark's for the source): the first micro-batch's Python
    # workers (their daemon imports Beam) start meanwhile.
    self._warming = threading.Thread(
        target=self._warm_workers, daemon=True,
        name=f'beam-pyspark-warm-{self.job_id}')
    self._warming.start()
    spark = self._unless_stopped(lambda: streaming_session(self.sc))
    if spark is None:
      return
    reader = spark.readStream.format(SOURCE_NAME).option(
        'location', self.checkpoint.url).option('control', self.root)
    for key, value in self.checkpoint.options:
      reader = reader.option(f'{_STORAGE_PREFIX}{key}', str(value))
    for key, value in self.options.items():
      reader = reader.option(key, str(value))
    if querystarts.busy():
      # Spark gives the source's process 10 s to start: on a busy machine
      # it does not share the CPU with the workers' start as well.
      self._pause(0)
    if self.stopping():  # stopped while its session started: no query
      return
    try:
      self._run_starts(reader)
    finally:
      _remove(os.path.join(self.root, STOP_MARKER))
      _remove(os.path.join(self.root, DRAIN_MARKER))
    if self._errors:
      # The engine's own error (a user's traceback), not Spark's wrapping.
      raise self._errors[0]

  def _run_starts(self, reader) -> None:
    """Runs the query; starts it again, after a pause, while it fails
    before its first micro-batch because Spark's source process did not
    connect back in time (a loaded machine: ``spark.querystarts``)."""
    first = time.monotonic()
    pauses = querystarts.start_pauses()
    for starts in itertools.count(1):
      try:
        self._run_query(reader)
        return
      except Exception as exn:  # pylint: disable=broad-except
        if self._errors or self.stopping():
          raise  # the engine's own error; a cancel
        _LOGGER.debug('Job %s: the query failed', self.job_id, exc_info=True)
        started = self._started is None  # a first micro-batch was offered
        cause = querystarts.failure_cause(exn)
        pause = None if started or (
            querystarts.NO_CONNECT_BACK not in cause) else next(pauses, None)
        if pause is None:
          raise querystarts.query_error(
              exn, starts, time.monotonic() - first, started) from None
        self.log(f'The streaming query did not start: Spark\'s Python '
                 'process for its source did not connect back within '
                 'Spark\'s fixed 10 s (a loaded machine). Starting it again '
                 f'in {pause} s (start {starts + 1}).')
        self._pause(pause)
        if self.stopping():
          return  # the engine raises its cancel

  def _pause(self, secs: float) -> None:
    """A pause between starts, cut short by a cancel or a stop; it lasts
    until the job's Python workers have started too (at most a minute
    more): they would compete with the source's process for the CPU."""
    deadline = time.monotonic() + secs
    while not self.stopping():
      now = time.monotonic()
      warming = self._warming is not None and self._warming.is_alive()
      if now >= deadline + (WARM_WAIT_SECS if warming else 0):
        return
      time.sleep(POLL_SECS * 4)

  def _run_query(self, reader) -> None:
    self._started = time.monotonic()
    frame = self._unless_stopped(reader.load)
    if frame is None:
      return
    query = (
        frame.writeStream.queryName(f'beam-{self.job_id}')
        .foreachBatch(self._each)
        .option('checkpointLocation', self.location).start())
    _LOGGER.debug('Job %s: query started in %.2f s', self.job_id,
                  time.monotonic() - self._started)
    try:
      ended = False
      while not ended and not self._errors:
        if self.finished() or self.stopping():
          # No batch is offered after this; wait for the running one.
          _touch(os.path.join(self.root, STOP_MARKER))
          if not query.status['isTriggerActive']:
            break
        try:
          # True once the query ended; Spark's error if it failed. One py4j
          # call a poll (with isActive as well, two: 40 a second, a
          # streaming job's driver's most frequent call while it idles).
          ended = query.awaitTermination(POLL_SECS)
        except Exception:  # pylint: disable=broad-except
          if not self._errors:
            raise
      if not query.isActive and not self._errors:
        # Only a failure ends a query that was not stopped. One that failed
        # before the loop first looked (on a loaded machine ``start()``
        # returns after Spark's 10 s for the source's process are over)
        # raises here: else the job ended DONE, nothing read.
        query.awaitTermination(POLL_SECS)
    finally:
      try:
        query.stop()
      except Exception:  # pylint: disable=broad-except
        pass

  def _unless_stopped(self, call: Callable[[], object]):
    """``call()``, or None once the job is stopping, without waiting for it
    to return: Spark's SQL session and the source's load take seconds each
    (tens on a loaded machine), and a Ctrl-C in start-up waited for them.
    What it raises, it raises here; left to finish, it raises nowhere."""
    done = threading.Event()
    result: list = []

    def run():
      try:
        result.append((True, call()))
      except BaseException as exn:  # pylint: disable=broad-except
        result.append((False, exn))
      done.set()

    threading.Thread(target=run, daemon=True,
                     name=f'beam-pyspark-start-{self.job_id}').start()
    while not done.wait(POLL_SECS * 2):
      if self.stopping():
        # The job's Spark jobs launched since its cancel (the workers').
        self.sc.cancelJobGroup(self.job_id)
        return None
    ok, value = result[0]
    if not ok:
      raise value
    return value

  def _warm_workers(self) -> None:
    try:
      self.sc.setJobGroup(self.job_id, f'Beam job {self.job_id}', True)
      start_python_workers(self.sc, f'Beam job {self.job_id}')
    except Exception:  # pylint: disable=broad-except
      # Only time is lost: the first micro-batch starts them itself.
      _LOGGER.debug('Job %s: warming Python workers failed', self.job_id,
                    exc_info=True)

  def _each(self, frame, batch_id) -> None:
    if self._errors:
      return
    try:
      # foreachBatch runs on a thread of its own: the job's Spark jobs
      # belong to its group there too (Cancel).
      self.sc.setJobGroup(self.job_id, f'Beam job {self.job_id}', True)
      if self._started is not None:
        _LOGGER.debug('Job %s: Spark offered micro-batch %d %.2f s after '
                      'the query\'s start', self.job_id, batch_id,
                      time.monotonic() - self._started)
        self._started = None
        self._starting = False
      trigger = self._logged_trigger(batch_id)
      if trigger is not None:
        self.run_batch(trigger)
        return
      for row in sorted(frame.collect(), key=lambda r: r.batch):
        self.run_batch(Trigger(row.batch, row.time, json.loads(row.grants)))
    except BaseException as exn:  # pylint: disable=broad-except
      self._errors.append(exn)
      raise


  def _logged_trigger(self, batch_id: int) -> Optional[Trigger]:
    """The micro-batch as Spark logged its offset before running it
    (``offsets/<id>``: a version line, Spark's metadata, then our source's
    offset), read without a Spark job over the source's rows (one a
    micro-batch, 0.1-0.3 s); None when the log does not read as one trigger
    (the rows are read then). Spark's batch id is ours, unless its query
    checkpoint started anew after ours had commits (``initialOffset``)."""
    try:
      if self._local_query:
        with open(os.path.join(self.location, 'offsets', str(batch_id)),
                  'rb') as f:
          text = f.read()
      else:
        text = self.checkpoint.store().read(
            posixpath.join('query', 'offsets', str(batch_id)))
      offset = json.loads(text.decode('utf-8').strip().splitlines()[-1])
      return Trigger(int(offset['batch']), offset['time'], offset['grants'])
    except Exception:  # pylint: disable=broad-except
      # OSError locally; a remote store's client raises its own.
      return None


# How often the driver looks whether the query should end.
POLL_SECS = 0.1
# How much longer than its pause a start waits for the job's Python
# workers to finish starting.
WARM_WAIT_SECS = 60
