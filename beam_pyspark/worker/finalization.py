"""Bundle finalization after a streaming micro-batch commits.

Beam asks runners to finalize a bundle (its DoFns' ``BundleFinalizerParam``
callbacks: acknowledge messages, delete files read) only once the bundle's
output is durably committed. In batch the task finalizes a bundle once its
output has left the task (worker.bundles). In a streaming job output is
committed when the driver renames the micro-batch's manifest into place,
after every task of it has ended: so a task hands its bundles to finalize
to this Python worker's registry, with the micro-batch they belong to, and
they are finalized by the next task of the job that learns the batch has
committed (a Spark job the driver runs after the commit, any later task of
the job, the job's release), on the harness that ran them.

Finalization is best effort, as Beam specifies it: a Python worker that
exits, or a harness dropped meanwhile, loses its callbacks; a batch that
never commits (its driver died) never finalizes.
"""

from __future__ import annotations

import logging
import threading

from apache_beam.portability.api import beam_fn_api_pb2

_LOGGER = logging.getLogger(__name__)

_lock = threading.Lock()
# job id -> [(micro-batch, harness, instruction id)]
_pending: dict[str, list[tuple[int, object, str]]] = {}


def defer(job_id: str, batch: int, harness, instruction_id: str) -> None:
  """Bundle ``instruction_id`` of ``batch``, finalized once it commits."""
  with _lock:
    _pending.setdefault(job_id, []).append((batch, harness, instruction_id))


def pending(job_id: str) -> int:
  with _lock:
    return len(_pending.get(job_id, ()))


def run_committed(job_id: str, committed: int) -> int:
  """Finalizes the job's bundles of micro-batches up to ``committed``;
  returns how many."""
  with _lock:
    waiting = _pending.get(job_id, [])
    due = [p for p in waiting if p[0] <= committed]
    rest = [p for p in waiting if p[0] > committed]
    if rest:
      _pending[job_id] = rest
    else:
      _pending.pop(job_id, None)
  for _, harness, instruction_id in due:
    _finalize(harness, instruction_id)
  return len(due)


def drop(job_id: str) -> None:
  """Forgets the job's bundles (it failed: nothing more commits)."""
  with _lock:
    _pending.pop(job_id, None)


def _finalize(harness, instruction_id: str) -> None:
  try:
    response = harness.do(beam_fn_api_pb2.InstructionRequest(
        instruction_id=harness.next_instruction_id(),
        finalize_bundle=beam_fn_api_pb2.FinalizeBundleRequest(
            instruction_id=instruction_id)))
  except Exception:  # pylint: disable=broad-except
    _LOGGER.warning('Could not finalize bundle %s', instruction_id,
                    exc_info=True)
    return
  if response.error:
    _LOGGER.warning('Finalizing bundle %s failed: %s', instruction_id,
                    response.error)
