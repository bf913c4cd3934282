"""The boundary between a job's lifecycle and the engine that runs it.

``execution.PipelineExecution`` owns a job's lifecycle (start, cancel,
state); an ``Engine`` runs its plan. Which engine runs a job is chosen per
job (``engine_kind``) from a registry keyed by kind, as Beam's worker
handlers are chosen by environment URN: an unknown kind is an error. Until
the streaming engine is registered, --streaming is refused and unbounded
PCollections run on the batch engine with a warning in the job's messages,
as before. Engines are imported lazily, so this module and
its callers need no Spark.
"""

from __future__ import annotations

import importlib
from typing import Callable
from typing import Optional
from typing import Protocol

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.options import RunnerOptions

BATCH = 'batch'
STREAMING = 'streaming'

# kind -> 'module:factory'; factory(plan, job_id, options, log) -> Engine.
ENGINES: dict[str, str] = {
    BATCH: 'beam_pyspark.spark.translate:create_batch_engine',
    STREAMING: 'beam_pyspark.spark.streaming:create_streaming_engine',
}


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


def unbounded_pcollections(pipeline: beam_runner_api_pb2.Pipeline) -> list[str]:
  unbounded = beam_runner_api_pb2.IsBounded.UNBOUNDED
  return sorted(
      pcoll.unique_name or pcoll_id
      for pcoll_id, pcoll in pipeline.components.pcollections.items()
      if pcoll.is_bounded == unbounded)


def engine_kind(pipeline: beam_runner_api_pb2.Pipeline,
                options: RunnerOptions) -> str:
  """Streaming for ``--streaming`` or an unbounded PCollection, else batch.

  A drained job is batch whatever its sources: drain truncates unbounded
  restrictions, so the job ends (Beam's FnApiRunner(is_drain) runs such
  pipelines to completion too).
  """
  if options.drain:
    return BATCH
  if options.streaming or unbounded_pcollections(pipeline):
    return STREAMING
  return BATCH


def check_engine(pipeline: beam_runner_api_pb2.Pipeline,
                 options: RunnerOptions) -> tuple[str, Optional[str]]:
  """(the engine kind that runs the job, a warning for its messages or None).

  While no streaming engine is registered, ``--streaming`` is refused, and
  a job with unbounded PCollections runs on the batch engine, as Beam's own
  FnApiRunner runs it: unbounded splittable
  DoFns are processed until they stop claiming (a PeriodicImpulse with a
  stop time ends; one without never does), watermarks and processing time
  are not simulated. That is how this runner behaved before the engine
  boundary existed, and Beam's conformance suite relies on it.
  """
  kind = engine_kind(pipeline, options)
  if kind in ENGINES:
    return kind, None
  if kind == STREAMING and options.streaming:
    # Asked for explicitly: streaming semantics (watermarks, triggers
    # firing before the end) that batch cannot give.
    raise UnsupportedPipelineError([
        'The pipeline was submitted with --streaming, and this version of '
        'beam-pyspark has no streaming engine yet (it is being built). Run '
        'it without --streaming: bounded sources run as batch, and '
        'unbounded ones are read until they stop themselves (or with '
        '--drain, what they hold now).'])
  if kind == STREAMING:
    unbounded = unbounded_pcollections(pipeline)
    why = (f'it has unbounded PCollections ({", ".join(unbounded[:5])}'
           f'{", ..." if len(unbounded) > 5 else ""})')
    return BATCH, (
        f'The pipeline asks for streaming execution: {why}. This version '
        'of beam-pyspark has no streaming engine yet, so it runs on the '
        'batch engine: unbounded sources are read until they stop '
        'themselves (one that never stops never finishes; use --drain to '
        'read what they have now and stop).')
  raise UnsupportedPipelineError(
      [f'No engine of kind {kind!r}; known: {sorted(ENGINES)}.'])


def create_engine(kind: str, plan, job_id: str, options: RunnerOptions,
                  log: Callable[..., None]) -> Engine:
  module_name, factory = ENGINES[kind].split(':')
  return getattr(importlib.import_module(module_name), factory)(
      plan, job_id, options, log)
