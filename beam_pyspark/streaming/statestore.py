"""Keyed state between waves as a chain of files: the rules, sans-I/O.

A keyed partition's state (a GroupByKey's trigger state per key, a
stateful stage's user state and timers) is a dict of *entries*, key ->
bytes. After a wave its task writes only the entries that changed since it
loaded them, as a *delta*, or, when a delta would be as large as the state
or the chain is long, a *snapshot*. The partition's state is its *chain*:
the names of its last snapshot and the deltas after it, which the driver
keeps, hands to the next wave's task and commits in the job's manifests
(Spark's HDFSBackedStateStore keeps its state the same way). So a wave
writes what it touched, and a task whose Python worker still holds the
chain it is given reads nothing (the worker side: ``worker.statestore``).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable
from typing import Optional

# Deltas after a snapshot before the next write is a snapshot.
MAX_DELTAS = 8

SNAPSHOT = 'snapshot'
DELTA = 'delta'


@dataclasses.dataclass
class Record:
  """One file of a chain: every entry (a snapshot), or the entries set and
  the keys removed since the file before it (a delta)."""
  kind: str
  upserts: dict
  deletes: tuple = ()


def changes(old: dict, new: dict) -> Record:
  """The delta from ``old`` to ``new`` (entries compared by identity
  first: unchanged entries are usually the very objects loaded)."""
  missing = object()
  upserts = {}
  for key, value in new.items():
    before = old.get(key, missing)
    if before is not value and before != value:
      upserts[key] = value
  return Record(DELTA, upserts, tuple(k for k in old if k not in new))


def next_record(chain: Optional[tuple], old: dict,
                new: dict) -> Optional[Record]:
  """What the task writes after a wave that took ``old`` to ``new``: None
  when nothing changed, else a delta or, for a new or long chain or a delta
  as large as the state, a snapshot."""
  delta = changes(old, new)
  if not delta.upserts and not delta.deletes and chain:
    return None
  if (not chain or len(chain) > MAX_DELTAS or
      len(delta.upserts) + len(delta.deletes) >= len(new)):
    return Record(SNAPSHOT, dict(new))
  return delta


def extend(chain: Optional[tuple], record: Record, name: str) -> tuple:
  """The chain once ``record`` is written as ``name``."""
  if record.kind == SNAPSHOT:
    return (name,)
  return tuple(chain or ()) + (name,)


def replay(records: Iterable[Record]) -> dict:
  """The entries a chain's records hold, read in order."""
  entries: dict = {}
  for record in records:
    if record.kind == SNAPSHOT:
      entries = dict(record.upserts)
    else:
      entries.update(record.upserts)
      for key in record.deletes:
        entries.pop(key, None)
  return entries
