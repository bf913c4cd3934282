"""Stopping a job's SDK harnesses in the Python workers when it ends.

A task per Python worker slot asks its worker to stop them (in-process
harnesses hold their DoFns' set-up resources, others a process), first
finalizing the job's bundles still waiting for a commit if the job
succeeded (worker.finalization); a worker that gets no such task stops
them when idle (worker.harnesses.IDLE_SECS).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Optional

from beam_pyspark.spark import naming
from beam_pyspark.worker import finalization
from beam_pyspark.worker import harnesses
from beam_pyspark.worker import statestore

_LOGGER = logging.getLogger(__name__)

# How long a program that ends waits for its jobs' releases.
RELEASE_AT_EXIT_SECS = 5.0

_lock = threading.Lock()
_running: list[threading.Thread] = []
_hooked: list[bool] = []


def release_harnesses(sc, job_id: str, succeeded: bool, wait: bool,
                      held: Optional[int] = None) -> None:
  """Releases ``job_id``'s harnesses: now (``wait``), or from a thread (in
  process harnesses: the job's end need not wait for a Spark job of its
  own, ~0.1-0.2 s). Not at all for a job that succeeded with no task
  leaving anything a release stops (``held`` 0: tasks.held; say a batch
  pipeline all on the fast path, its DoFns without setup or teardown):
  the release is a Spark job of a task per slot, ~0.15 CPU-s a task, a
  fixed cost of every pipeline otherwise."""
  if succeeded and held == 0:
    return
  slots = 2 * max(1, sc.defaultParallelism)

  def release():
    try:
      what = f'Beam job {job_id}: release its SDK harnesses'
      sc.setJobGroup(f'{job_id}-release', what, True)
      with naming.call_site(sc, what):
        sc.parallelize(range(slots), slots).foreach(
            ReleaseJob(job_id, succeeded))
    except Exception:  # pylint: disable=broad-except
      # A context stopped meanwhile took the harnesses with its workers.
      stopped = getattr(sc, '_jsc', None) is None
      _LOGGER.log(logging.DEBUG if stopped else logging.WARNING,
                  'Could not release the harnesses of %s', job_id,
                  exc_info=True)

  if wait:
    release()
    return
  thread = threading.Thread(target=release, name=f'release-{job_id}',
                            daemon=True)
  thread.start()
  with _lock:
    _running[:] = [t for t in _running if t.is_alive()]
    _running.append(thread)
    if not _hooked:
      # A release cut off by the interpreter's exit makes Spark log errors
      # about its accumulators' closed socket: a program that ends waits
      # for them, a little. Registered after the SparkContext's own exit
      # hook, so run before it (hooks run last first).
      atexit.register(_wait_for_releases)
      _hooked.append(True)


def _wait_for_releases() -> None:
  wait_for_releases(RELEASE_AT_EXIT_SECS)


def wait_for_releases(timeout: float) -> None:
  """Waits (at most ``timeout`` seconds) for the releases under way: a
  program about to change the SparkContext's environment (a Python worker
  pool's key) waits, as a release reads it when it starts its Spark job."""
  deadline = time.monotonic() + timeout
  with _lock:
    threads = list(_running)
  for thread in threads:
    thread.join(max(0.0, deadline - time.monotonic()))


class ReleaseJob:
  """foreach: stop the job's harnesses in this Python worker; first, for a
  job that succeeded, finalize its bundles still waiting (streaming)."""
  def __init__(self, job_id: str, succeeded: bool = False):
    self.job_id = job_id
    self.succeeded = succeeded

  def __call__(self, _):
    if self.succeeded:
      finalization.run_committed(self.job_id, float('inf'))
    finalization.drop(self.job_id)
    harnesses.release_job(self.job_id)
    statestore.release(self.job_id)


class FinalizeCommitted:
  """foreach: finalize the job's bundles of committed micro-batches that
  wait in this Python worker (worker.finalization)."""
  def __init__(self, job_id: str, committed: int):
    self.job_id = job_id
    self.committed = committed

  def __call__(self, _):
    finalization.run_committed(self.job_id, self.committed)
