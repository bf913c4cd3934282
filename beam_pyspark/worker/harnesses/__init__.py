"""SDK harnesses: one interface, kinds chosen by environment URN, one cache.

A stage's bundles run on a ``Harness`` (base.py): in this process
(embedded.py) or in a process of its own over the gRPC Fn API (remote.py,
servers.py). Which kind serves a stage is chosen from ``KINDS`` by the
stage's concrete environment URN, as Beam's ``worker_handlers`` chooses a
worker handler: an unknown URN is an error. (Validation refuses such
pipelines before they run: ``planning.validate.SUPPORTED_ENVIRONMENTS``
lists the same URNs, and a test keeps the two equal.)

Harnesses cost descriptor parsing and DoFn setup, or a process, so one
cache per Python worker keeps them across tasks: an embedded harness per
(job, stage), a remote one per (job, environment). One release path:
``release_job`` when the job ends (the engine runs a task per Python worker
slot for it), and for workers that task missed, eviction once idle for
``IDLE_SECS`` or past ``MAX_HARNESSES``; ``stop_all`` when the Python
worker is about to go.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.validate import concrete_environment
from beam_pyspark.worker.harnesses.base import BundleOutput
from beam_pyspark.worker.harnesses.base import CollectedBundle
from beam_pyspark.worker.harnesses.base import DelegatingStateHandler
from beam_pyspark.worker.harnesses.base import Harness
from beam_pyspark.worker.harnesses.base import HarnessLostError

__all__ = [
    'BundleOutput', 'CollectedBundle', 'DelegatingStateHandler', 'Harness',
    'HarnessLostError',
    'KINDS', 'acquire', 'discard', 'discard_after_error', 'kind_for',
    'release_job', 'release_waits', 'stop_all'
]

_LOGGER = logging.getLogger(__name__)

IDLE_SECS = 120.0
MAX_HARNESSES = 32
# How long a failed task waits for its worker's harnesses to stop.
STOP_ALL_SECS = 10.0


@dataclasses.dataclass(frozen=True)
class HarnessKind:
  name: str
  # 'module:Class' with a for_stage(job_id, stage, components, job_options)
  # factory; imported when first needed.
  factory: str
  # What one harness serves: 'stage' (its descriptor is fixed) or
  # 'environment' (any stage of the environment).
  per: str
  # Whether the runner may split its straggling splittable bundles.
  splits_bundles: bool
  # Whether it runs in the Python worker itself (no process of its own).
  in_process: bool

  def create(self, job_id, stage, components, job_options) -> Harness:
    import importlib  # pylint: disable=import-outside-toplevel
    module, cls = self.factory.split(':')
    return getattr(importlib.import_module(module), cls).for_stage(
        job_id, stage, components, job_options)

  def key(self, job_id: str, stage) -> tuple:
    return (job_id, self.per,
            stage.name if self.per == 'stage' else stage.environment_id)


EMBEDDED = HarnessKind(
    'in-process', 'beam_pyspark.worker.harnesses.embedded:EmbeddedHarness',
    'stage', splits_bundles=False, in_process=True)
REMOTE = HarnessKind(
    'gRPC', 'beam_pyspark.worker.harnesses.remote:RemoteHarness',
    'environment', splits_bundles=True, in_process=False)

KINDS: dict[str, HarnessKind] = {
    python_urns.EMBEDDED_PYTHON: EMBEDDED,
    python_urns.EMBEDDED_PYTHON_GRPC: REMOTE,
    python_urns.SUBPROCESS_SDK: REMOTE,
    common_urns.environments.PROCESS.urn: REMOTE,
    common_urns.environments.EXTERNAL.urn: REMOTE,
}


def kind_for(environment) -> HarnessKind:
  """The kind of harness that runs ``environment`` (None: in process)."""
  if environment is None:
    return EMBEDDED
  urn = concrete_environment(environment).urn
  kind = KINDS.get(urn)
  if kind is None:
    raise PipelineExecutionError(
        f'No SDK harness runs environment {urn!r}; known: '
        f'{", ".join(sorted(KINDS))}.')
  return kind


def release_waits(components, plan) -> bool:
  """Whether a job's end waits for the release of its harnesses: only when
  one of them is a process this runner started (PROCESS, Beam's subprocess
  environments), which a program that exits right after its pipeline would
  leave running. In-process harnesses, and EXTERNAL (LOOPBACK) ones, which
  are their worker pool's and live as long as it wants, are released after
  the job is reported done: the release is a Spark job of a task per slot,
  each waiting out its servers' shutdown grace (~1.1 s of a small Java
  LOOPBACK job's ~2.8-3.7 s on local[2]; Java's client polls a job's state
  every 3 s, so a job done in 3.1 s is seen done at 6)."""
  for stage in plan.stages:
    environment = _environment(stage, components)
    if (not kind_for(environment).in_process and
        concrete_environment(environment).urn !=
        common_urns.environments.EXTERNAL.urn):
      return True
  return False


def _environment(stage, components):
  env_id = stage.environment_id
  return components.environments[env_id] if env_id else None


# -- the cache ------------------------------------------------------------------

_lock = threading.Lock()
_harnesses: 'collections.OrderedDict[tuple, Harness]' = collections.OrderedDict()


def acquire(job_id: str, stage, components, job_options: Optional[dict]
            ) -> Harness:
  """The cached harness for ``stage`` of ``job_id``, created if needed."""
  kind = kind_for(_environment(stage, components))
  key = kind.key(job_id, stage)
  stale = []
  with _lock:
    harness = _harnesses.get(key)
    if harness is not None and (
        getattr(harness, 'abandoned', False) or harness.dead()):
      stale.append(_harnesses.pop(key))
      harness = None
    now = time.monotonic()
    for other_key, other in list(_harnesses.items()):
      if getattr(other, 'abandoned', False):
        # Its aborted bundle's reader, or that bundle's thread, stops it.
        del _harnesses[other_key]
      elif (other_key != key and now - other.last_used > IDLE_SECS and
            not other.in_use()):
        stale.append(_harnesses.pop(other_key))
  _stop(stale)
  _ensure_reaper()
  _stop_on_hangup()
  if harness is None:
    harness = kind.create(job_id, stage, components, job_options)
    with _lock:
      _harnesses[key] = harness
      evicted = []
      while len(_harnesses) > MAX_HARNESSES:
        evicted.append(_harnesses.popitem(last=False)[1])
    _stop(evicted)
  with _lock:
    if key in _harnesses:
      _harnesses.move_to_end(key)
    harness.last_used = time.monotonic()
  return harness


def keep(job_id: str, name: str, create) -> object:
  """The object cached as ``name`` of ``job_id``, ``create()``-d if none
  is cached or the cached one is in use. Such objects (the fast path's
  set-up DoFns: ``worker.fastpath.chain.Instances``) are released as
  harnesses are, and like them have ``last_used``, ``in_use()``,
  ``dead()`` and ``shutdown()``; one in use is not cached twice."""
  key = (job_id, 'object', name)
  with _lock:
    kept = _harnesses.get(key)
    if kept is not None and not kept.in_use() and kept.dead() is None:
      _harnesses.move_to_end(key)
      kept.last_used = time.monotonic()
      return kept
  _ensure_reaper()
  _stop_on_hangup()
  kept = create()
  kept.last_used = time.monotonic()
  with _lock:
    if key not in _harnesses or _harnesses[key].dead() is not None:
      stale = _harnesses.pop(key, None)
      _harnesses[key] = kept
    else:
      stale = None  # another one is cached; this one is the task's own
      kept.uncached = True
    evicted = [stale] if stale is not None else []
    while len(_harnesses) > MAX_HARNESSES:
      evicted.append(_harnesses.popitem(last=False)[1])
  _stop(evicted)
  return kept


def forget(job_id: str, name: str, kept) -> None:
  """Drops ``kept`` from the cache (after a failure, as Beam discards a
  bundle processor) and shuts it down."""
  key = (job_id, 'object', name)
  with _lock:
    if _harnesses.get(key) is kept:
      del _harnesses[key]
  _stop([kept])


def cached(job_id: str, stage, components) -> Optional[Harness]:
  """The harness ``acquire`` would return now, if cached (for tests)."""
  kind = kind_for(_environment(stage, components))
  with _lock:
    return _harnesses.get(kind.key(job_id, stage))


def discard(job_id: str, stage, components) -> None:
  """Drops the stage's harness (e.g. its Fn API channel failed)."""
  kind = kind_for(_environment(stage, components))
  with _lock:
    harness = _harnesses.pop(kind.key(job_id, stage), None)
  _stop([harness] if harness is not None else [])


def discard_after_error(job_id: str, stage, components,
                        harness: Optional[Harness]) -> None:
  """After a failed bundle: drop the harness unless it may be reused."""
  if harness is None:
    return
  try:
    reusable = harness.reusable_after_error()
  except Exception:  # pylint: disable=broad-except
    reusable = False
  if not reusable:
    discard(job_id, stage, components)


def release_job(job_id: str) -> None:
  """Stops every harness of ``job_id`` in this Python worker."""
  with _lock:
    keys = [k for k in _harnesses if k[0] == job_id]
    harnesses = [_harnesses.pop(k) for k in keys]
  _stop(harnesses)


def holds(job_id: str) -> bool:
  """Whether ``release_job`` would stop anything of ``job_id`` here: a
  harness, or a kept object whose ``needs_release()`` says so."""
  with _lock:
    kept = [h for k, h in _harnesses.items() if k[0] == job_id]
  return any(getattr(h, 'needs_release', lambda: True)() for h in kept)


def count(job_id: Optional[str] = None) -> int:
  with _lock:
    return sum(1 for k in _harnesses if job_id is None or k[0] == job_id)


def _stop(harnesses) -> None:
  for harness in harnesses:
    try:
      harness.shutdown()
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('Error stopping an SDK harness', exc_info=True)


def _reap_idle() -> None:
  """Stops harnesses idle for IDLE_SECS (their job has likely ended)."""
  while True:
    time.sleep(max(1.0, IDLE_SECS / 4))
    now = time.monotonic()
    with _lock:
      idle = [k for k, h in _harnesses.items()
              if now - h.last_used > IDLE_SECS and not h.in_use()]
      stale = [_harnesses.pop(k) for k in idle]
    _stop(stale)


_reaper: Optional[threading.Thread] = None


def _ensure_reaper() -> None:
  global _reaper
  with _lock:
    if _reaper is None or _reaper.ident is None or not _reaper.is_alive():
      _reaper = threading.Thread(
          target=_reap_idle, name='beam-pyspark-harness-reaper', daemon=True)
      _reaper.start()


def stop_all(timeout: float = STOP_ALL_SECS) -> None:
  """Stops every harness of this Python worker, waiting at most ``timeout``.

  For a Python worker about to go: PySpark ends the worker of a failed task
  with ``os._exit`` (no atexit hook), and a stopping Spark ends its workers
  with SIGHUP (``_stop_on_hangup``). Servers that vanish with the process
  leave each remote harness's open state stream to gRPC's retries (Beam's
  policy for UNAVAILABLE), refused connections whose backoff gRPC's
  process-wide subchannel pool shares with any later channel to the same
  address: in a process of many harnesses (LOOPBACK's client) a later
  harness whose server got the freed port then fails its state stream at
  once ("failed to connect to all addresses"), and Beam keeps that error. A
  harness stopped first ends its streams cleanly.
  """
  with _lock:
    harnesses = list(_harnesses.values())
    _harnesses.clear()
  if not harnesses:
    return
  # A harness stuck in user code never lets its control stream end: the
  # task's failure must not wait for it.
  stopper = threading.Thread(
      target=_stop, args=(harnesses,), name='beam-pyspark-harness-stop',
      daemon=True)
  stopper.start()
  stopper.join(timeout)


_hangup_for_pid: Optional[int] = None


def _stop_on_hangup() -> None:
  """PySpark's daemon ends its Python workers with SIGHUP when Spark stops
  (their default action: die at once). A worker with harnesses stops them
  first (``stop_all``), then dies of the signal as it would have."""
  global _hangup_for_pid
  if _hangup_for_pid == os.getpid():
    return
  if threading.current_thread() is not threading.main_thread():
    return  # only the main thread may set a handler; tasks run there
  if signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None):
    return  # not PySpark's worker default: someone else's handler
  _hangup_for_pid = os.getpid()

  def on_hangup(signum, _frame):
    stop_all(STOP_ALL_SECS / 2)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)

  signal.signal(signal.SIGHUP, on_hangup)


@atexit.register
def _shutdown_all() -> None:
  with _lock:
    harnesses = list(_harnesses.values())
    _harnesses.clear()
  _stop(harnesses)

