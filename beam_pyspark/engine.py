"""The boundary between a job's lifecycle and the engine that runs it.

``execution.PipelineExecution`` owns a job's lifecycle (start, cancel,
state); an ``Engine`` runs its plan. Which engine runs a job is chosen per
job (``engine_kind``) from a registry keyed by kind, as Beam's worker
handlers are chosen by environment URN: an unknown kind is an error.
Batch (``spark.translate``) runs bounded pipelines; streaming
(``spark.streaming``) runs those with ``--streaming``, an unbounded
PCollection or a TestStream. Engines are imported lazily, so this module
and its callers need no Spark; one thread at a time imports them
(``load``).
"""

from __future__ import annotations

import importlib
import threading
from typing import Callable
from typing import Optional
from typing import Protocol

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.options import RunnerOptions
from beam_pyspark.storage import Location
from beam_pyspark.storage import checked
from beam_pyspark.storage import storage_options

BATCH = 'batch'
STREAMING = 'streaming'
CONNECT = 'connect'

# kind -> 'module:factory'; factory(plan, job_id, options, log) -> Engine.
ENGINES: dict[str, str] = {
    BATCH: 'beam_pyspark.spark.translate:create_batch_engine',
    STREAMING: 'beam_pyspark.spark.streaming:create_streaming_engine',
    # Batch over Spark Connect's DataFrame API (docs/spark-connect.md).
    CONNECT: 'beam_pyspark.connect.engine:create_connect_engine',
}

# kind -> 'module:function' for kinds that checkpoint a job as it runs;
# function(location) -> the last micro-batch committed there, or None.
CHECKPOINTS: dict[str, str] = {
    STREAMING: 'beam_pyspark.spark.checkpoints:last_committed',
}
# Where checkpoints may be: a local path, or a scheme of storage.REMOTE_SCHEMES.


class Engine(Protocol):
  """Runs one job's plan; cancellable and observable from other threads."""
  def run(self) -> None:
    """Blocks until the job is done; raises JobCancelledError when
    cancelled and PipelineExecutionError (the user's error) on failure."""

  def cancel(self) -> None:
    """Asks the running job to stop; run() then raises JobCancelledError."""

  def metrics(self) -> tuple[list, list]:
    """(committed, attempted) MonitoringInfos so far: live while running."""

  def describe(self) -> str:
    """Where the job runs, for the job's messages (e.g. 'Spark local[2]')."""


# What an engine may also offer, looked up by name (``PipelineExecution``
# passes them on; the status page shows what there is). Each returns plain
# data (dicts, lists, strings, numbers), since readers know nothing of
# Spark:
#
#   progress() -> dict          Spark tasks done/active/failed/total over
#                               the job's Spark jobs, per Spark stage, the
#                               Spark UI's URL (spark.progress), and per
#                               fused stage the tasks that ended
#                               ('beam_stages': {stage name: count})
#   streaming_status() -> dict  a streaming job's own state, e.g.
#                               {'watermarks': {stage: ...}, 'endpoints':
#                               {name: {'grant': .., 'backlog': ..}},
#                               'micro_batches': [{'batch': .., 'secs': ..}]}:
#                               each key becomes a table of the job's page
OPTIONAL_METHODS = ('progress', 'streaming_status')


def unbounded_pcollections(pipeline: beam_runner_api_pb2.Pipeline) -> list[str]:
  unbounded = beam_runner_api_pb2.IsBounded.UNBOUNDED
  return sorted(
      pcoll.unique_name or pcoll_id
      for pcoll_id, pcoll in pipeline.components.pcollections.items()
      if pcoll.is_bounded == unbounded)


def engine_kind(pipeline: beam_runner_api_pb2.Pipeline,
                options: RunnerOptions) -> str:
  """Streaming for ``--streaming`` or an unbounded PCollection (a
  TestStream's are), else batch.

  A drained job is batch whatever its sources: drain truncates unbounded
  restrictions, so the job ends (Beam's FnApiRunner(is_drain) runs such
  pipelines to completion too).
  """
  streaming = not options.drain and bool(
      options.streaming or unbounded_pcollections(pipeline))
  if over_connect(options):
    return STREAMING if streaming else CONNECT
  return STREAMING if streaming else BATCH


def over_connect(options: RunnerOptions) -> bool:
  """Whether the job runs over Spark Connect: ``--spark_remote``, else
  as PySpark decides (connect.session.remote_url; no Spark imported)."""
  from beam_pyspark.connect.session import remote_url
  return remote_url(options.remote) is not None


def check_engine(pipeline: beam_runner_api_pb2.Pipeline,
                 options: RunnerOptions) -> str:
  """The engine kind that runs the job; an unknown kind is an error."""
  kind = engine_kind(pipeline, options)
  if kind == STREAMING and over_connect(options):
    raise UnsupportedPipelineError([
        'Streaming pipelines (--streaming, an unbounded PCollection or a '
        'TestStream) do not run over Spark Connect yet: the streaming '
        'engine drives micro-batches through the SparkContext, which a '
        'Connect client has not, and a Connect server runs foreachBatch '
        'cut off from the runner. Run them with a SparkContext (no '
        '--spark_remote, no SPARK_REMOTE; docs/spark-connect.md).'])
  if kind not in ENGINES:
    raise UnsupportedPipelineError(
        [f'No engine of kind {kind!r}; known: {sorted(ENGINES)}.'])
  return kind


# PySpark's modules import each other in cycles (pyspark -> pyspark.core
# -> pyspark.serializers -> pyspark ...): two threads importing them at
# once each see the other's half-made module, and one fails with
# "cannot import name ... from partially initialized module" or "No module
# named 'pyspark.rdd'" - and PySpark caches the failure (is_remote_only()
# stays True), so every later job of the process failed the same way. A
# job server ran its jobs' first imports in parallel (Beam's Go suite
# submits many jobs at once) and beside its Spark warm-up.
_IMPORTING = threading.RLock()


def load(target: str):
  """``'module:attribute'``'s attribute, the module imported by one
  thread at a time (see _IMPORTING)."""
  module_name, attribute = target.split(':')
  with _IMPORTING:
    module = importlib.import_module(module_name)
  return getattr(module, attribute)


def create_engine(kind: str, plan, job_id: str, options: RunnerOptions,
                  log: Callable[..., None]) -> Engine:
  return load(ENGINES[kind])(plan, job_id, options, log)


# 'module:function'; function(master, conf): the engines' shared start-up
# done ahead of the first job (a job server calls it when it starts).
CONNECT_WARM_UP = 'beam_pyspark.connect.engine:warm_up'
WARM_UP = 'beam_pyspark.spark.sources:warm_up_spark'


def warm_up(master: str, conf: Optional[dict] = None,
            remote: Optional[str] = None) -> None:
  """Starts what the first job would wait for (Spark, its SQL session,
  the streaming source; over Spark Connect, the session): a job server
  does this in the background."""
  from beam_pyspark.connect.session import remote_url
  if remote_url(remote) is not None:
    load(CONNECT_WARM_UP)(remote)
    return
  load(WARM_UP)(master, conf)


def last_committed(kind: str, location: Location) -> Optional[int]:
  """The last micro-batch an engine of ``kind`` committed to its
  checkpoint at ``location``: where a job started again there goes on
  from. None when nothing committed there, or the kind keeps no
  checkpoint."""
  if kind not in CHECKPOINTS:
    return None
  return load(CHECKPOINTS[kind])(location)


def checkpoint_location(location: str,
                        job_options: Optional[dict] = None) -> Location:
  """The location a ``--checkpoint_location`` names, reached with the
  job's storage options (``storage``). Raises InvalidOptionsError naming
  the option for a scheme this runner does not write, or whose library
  is not installed (naming the package's extra to install)."""
  return Location.parse(location, storage_options(job_options))


def checkpoint_path(location: str) -> str:
  """A ``--checkpoint_location`` as this runner names it: a local path
  made absolute, a URL normalized (``checkpoint_location``)."""
  return checkpoint_location(location).url


def checked_checkpoint_location(location: str,
                                job_options: Optional[dict] = None) -> str:
  """``checkpoint_path(location)``, checked at submission: a location
  that exists or can be made, and that this process can write to. Raises
  InvalidOptionsError naming the option (a location under /proc or under
  a regular file failed later with a bare FileNotFoundError or
  NotADirectoryError; hdfs://namenode:8020/ckpt made a local directory
  './hdfs:/namenode:8020/ckpt' and failed 19 s on)."""
  return checked(location, storage_options(job_options)).url
