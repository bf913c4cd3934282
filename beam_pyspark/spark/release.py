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
import os
import socket
import threading
import time
from typing import Optional

from beam_pyspark.spark import naming
from beam_pyspark.worker import finalization
from beam_pyspark.worker import harnesses
from beam_pyspark.worker import statestore

_LOGGER = logging.getLogger(__name__)

# How many rounds of a task per slot a release runs to reach the Python
# workers that hold something of the job's.
RELEASE_ROUNDS = 8

# How long a program that ends waits for its jobs' releases.
RELEASE_AT_EXIT_SECS = 5.0

_lock = threading.Lock()
_running: list[threading.Thread] = []
_hooked: list[bool] = []


def release_harnesses(sc, job_id: str, succeeded: bool, wait: bool,
                      held: Optional[set] = None) -> None:
  """Releases ``job_id``'s harnesses: now (``wait``), or from a thread (in
  process harnesses: the job's end need not wait for a Spark job of its
  own, ~0.1-0.2 s). Not at all for a job that succeeded with no task
  leaving anything a release stops (``held`` empty: tasks.held; say a batch
  pipeline all on the fast path, its DoFns without setup or teardown):
  the release is a Spark job of a task per slot, ~0.15 CPU-s a task, a
  fixed cost of every pipeline otherwise.

  A round of a task per slot need not reach every Python worker: Spark
  keeps more idle workers than slots (a task reading a persisted Python
  RDD's first computation holds a worker for each), and hands them out
  oldest first. With ``held`` (the workers that hold something, named by
  ``worker_id``) the release runs rounds until each has been visited
  (at most RELEASE_ROUNDS); without, one round."""
  if succeeded and held is not None and not held:
    return
  slots = 2 * max(1, sc.defaultParallelism)

  def release():
    try:
      what = f'Beam job {job_id}: release its SDK harnesses'
      sc.setJobGroup(f'{job_id}-release', what, True)
      remaining = set(held) if held else None
      seen: set = set()
      with naming.call_site(sc, what):
        for _ in range(RELEASE_ROUNDS):
          visited = set(sc.parallelize(range(slots), slots).mapPartitions(
              ReleaseJob(job_id, succeeded)).collect())
          if remaining is None or visited <= seen:
            # (A round of workers seen before: the pool went round; the
            # rest ended, say Spark stopped them idle.)
            break
          seen |= visited
          remaining -= visited
          if not remaining:
            break
      if remaining:
        # Their idle reaper stops them (worker.harnesses.IDLE_SECS).
        _LOGGER.debug('The release of %s did not reach %s', job_id,
                      sorted(remaining))
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
  """mapPartitions: stop the job's harnesses in this Python worker; first,
  for a job that succeeded, finalize its bundles still waiting (streaming).
  Yields this worker's ``worker_id``."""
  def __init__(self, job_id: str, succeeded: bool = False):
    self.job_id = job_id
    self.succeeded = succeeded

  def __call__(self, partition):
    for _ in partition:
      pass
    self.release()
    yield worker_id()

  def release(self) -> None:
    if self.succeeded:
      finalization.run_committed(self.job_id, float('inf'))
    finalization.drop(self.job_id)
    harnesses.release_job(self.job_id)
    statestore.release(self.job_id)


def worker_id() -> str:
  """This Python worker, among all of the cluster's."""
  return f'{socket.gethostname()}:{os.getpid()}'


class FinalizeCommitted:
  """foreach: finalize the job's bundles of committed micro-batches that
  wait in this Python worker (worker.finalization)."""
  def __init__(self, job_id: str, committed: int):
    self.job_id = job_id
    self.committed = committed

  def __call__(self, _):
    finalization.run_committed(self.job_id, self.committed)
