"""Streaming jobs across job-server restarts: where their checkpoints
live, and which jobs an earlier run of the server left unfinished a new
one runs again.

A streaming job commits each micro-batch to its checkpoint location, and
a job started again with the same pipeline and location goes on after the
last commit (docs/guide/checkpoints.md, "Through a job server"). The job server gives a streaming job
whose options name no ``--checkpoint_location`` one of its own under
``--artifacts-dir``, ``checkpoints/<job>``, which outlives the server's
process (``PySparkRunner``'s default, a temporary directory removed when
the job ends, would not); the engine removes it when the job ends DONE,
and the registry when the job leaves the history (``forget``).

At start-up the registry asks ``after_restart`` about each job that was
running, or stopped by SIGTERM, when the last run of the server ended: a
streaming job whose checkpoint directory is there is run again from it
(``Resume``); one whose directory is gone ends FAILED, saying so; any
other job is not this module's (it ends FAILED as before). Whether the
checkpoint holds this pipeline the engine checks when it resumes
(``CheckpointMismatch`` fails the job, with its reason).

Files and decisions only: no Spark, no gRPC.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
from typing import Optional
from typing import Union

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.engine import STREAMING
from beam_pyspark.engine import checked_checkpoint_location
from beam_pyspark.engine import checkpoint_location
from beam_pyspark.engine import engine_kind
from beam_pyspark.engine import last_committed
from beam_pyspark.options import RunnerOptions

CHECKPOINTS_DIR = 'checkpoints'
# Job ids hold the user's job name (up to 256 characters, any of them):
# a directory name keeps a readable part of it and a hash of all of it.
_READABLE_CHARS = 100


@dataclasses.dataclass(frozen=True)
class Resume:
  """Run the job again from its checkpoint."""
  location: str
  batch: Optional[int]  # the last micro-batch committed; None: none yet

  def message(self) -> str:
    if self.batch is None:
      return ('Resumed after the job server restarted: no micro-batch had '
              f'committed to its checkpoint ({self.location}), so it runs '
              'from its start.')
    return ('Resumed from its checkpoint after the job server restarted: '
            f'micro-batch {self.batch} was the last one committed (to '
            f'{self.location}); the job goes on after it.')


class StreamingRecovery:
  """The job server's streaming jobs' checkpoints, under ``artifacts_dir``."""
  def __init__(self, artifacts_dir: str):
    self.root = os.path.join(artifacts_dir, CHECKPOINTS_DIR)

  def owned(self, job_id: str) -> str:
    """The checkpoint directory the server gives ``job_id`` (used only
    when the job's options name none)."""
    readable = re.sub(r'[^A-Za-z0-9._-]', '_', job_id)[:_READABLE_CHARS]
    digest = hashlib.sha256(job_id.encode('utf-8')).hexdigest()[:16]
    return os.path.join(self.root, f'{readable}-{digest}')

  def assign(self, job_id: str, pipeline: beam_runner_api_pb2.Pipeline,
             options: RunnerOptions) -> None:
    """Before the job's engine is built: a streaming job's checkpoint
    location is its own option, else the server's for it; the directory is
    made now, so that after a restart a missing one means it was removed,
    not that the job had yet to make it. Raises InvalidOptionsError (a
    ValueError: an option the server cannot honour) for a location of a
    scheme it cannot write, or that it cannot create or write to."""
    if engine_kind(pipeline, options) != STREAMING:
      return
    options.checkpoint_location = checked_checkpoint_location(
        options.checkpoint_location or self.owned(job_id),
        options.job_options)

  def after_restart(self, job_id: str, pipeline: beam_runner_api_pb2.Pipeline,
                    options: dict) -> Union[Resume, str, None]:
    """For a job that was running (or stopped by SIGTERM) when the last
    run of the server ended: ``Resume`` for a streaming job whose
    checkpoint is there; why not (a message) for one whose checkpoint is
    gone; None for a job that is not streaming. Raises ValueError for
    options that do not parse (the job cannot have run)."""
    runner_options = RunnerOptions.from_job_options(options)
    kind = engine_kind(pipeline, runner_options)
    if kind != STREAMING:
      return None
    location = checkpoint_location(
        runner_options.checkpoint_location or self.owned(job_id),
        runner_options.job_options)
    try:
      if not location.store().isdir(''):
        return (f'The job server stopped while this streaming job was '
                f'running, and its checkpoint directory {location.url} is '
                'gone, so it cannot resume: submit the job again to run it '
                'from its start.')
      return Resume(location.url, last_committed(kind, location))
    except Exception as exn:  # pylint: disable=broad-except
      # HDFS or an object store out of reach (each client has its errors).
      reason = (str(exn).strip().splitlines() or [''])[0][:300]
      return (f'The job server stopped while this streaming job was running, '
              f'and its checkpoint at {location.url} cannot be read now '
              f'({type(exn).__name__}: {reason}): submit the same pipeline '
              f'with --checkpoint_location={location.url} to resume from it '
              'once it can be.')

  def forget(self, job_id: str) -> None:
    """The job left the history: the checkpoint the server gave it goes
    too (a location of the job's own options is the user's to remove)."""
    shutil.rmtree(self.owned(job_id), ignore_errors=True)
