"""What a streaming job's checkpoint holds, and which of its files live:
the bookkeeping, sans-I/O (the files are ``spark.checkpoints``').

After each micro-batch settles, the driver commits a *manifest*: the
batch's index, the pipeline's fingerprint, the driver's own state (the
watermarks, when each keyed partition's timers are next due, main input
held back, the processing time) and, by name, the files holding what is
too large to rewrite every batch (each keyed partition's state, each side
input's contents). A file is written only when its content changed, so a
batch costs what it touched; a manifest renamed into place is the commit.
A restarted driver resumes after the latest manifest, whose files are
exactly the state that batch committed: a batch that was running when the
driver died runs again from there, so its effects are counted once.

``ManifestBook`` tracks, between commits, which entries changed, and
which files no manifest still kept refers to (compaction).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import TYPE_CHECKING
from typing import Iterable
from typing import Optional

if TYPE_CHECKING:  # not imported where manifests are read (microbatches)
  from apache_beam.portability.api import beam_runner_api_pb2

# Manifests kept besides the latest (so that a manifest whose files were
# half deleted is never the only one).
KEEP_MANIFESTS = 2


class CheckpointMismatch(ValueError):
  """The checkpoint belongs to another pipeline."""


# Transforms Beam's fusion adds, numbered in an order that may differ
# between two processes (a Flatten's inputs: Flatten/Write/0, /1, ...).
_NUMBERED = re.compile(r'/(Write|Transcode)/\d+$')


def stage_key(transform_names: Iterable[str]) -> str:
  """A fused stage's name for checkpoints: its transforms, sorted, with
  the numbers of fusion's own transforms dropped. Fusing the same
  pipeline in another process may order or number them differently (the
  stage's own name then differs), never group them differently."""
  return ' + '.join(sorted(_NUMBERED.sub(r'/\1', n) for n in transform_names))


def fingerprint(components: beam_runner_api_pb2.Components,
                stage_keys: Iterable[str] = ()) -> str:
  """A pipeline's shape: its transforms by name and kind and how they
  connect, and its fused stages (``stage_key``). The same program built
  again has the same fingerprint (pickled DoFns may differ byte for byte
  between two builds, so they are left out); a changed graph has
  another."""
  names = {pid: p.unique_name for pid, p in components.pcollections.items()}
  rows = sorted(
      (t.unique_name, t.spec.urn,
       tuple(sorted((tag, names.get(p, p)) for tag, p in t.inputs.items())),
       tuple(sorted((tag, names.get(p, p)) for tag, p in t.outputs.items())))
      for t in components.transforms.values())
  return hashlib.sha256(
      repr((rows, sorted(stage_keys))).encode('utf-8')).hexdigest()


@dataclasses.dataclass
class Manifest:
  batch: int  # the last micro-batch committed
  fingerprint: str
  files: dict  # entry key (a tuple) -> file name, or a chain (tuple) of them
  driver: dict  # plain data: watermarks, timers due, held input, time


class ManifestBook:
  """The files of the committed manifests and the entries changed since."""
  def __init__(self, fingerprint_: str,
               history: Iterable[Manifest] = ()):
    self.fingerprint = fingerprint_
    self._history: list[Manifest] = sorted(history, key=lambda m: m.batch)
    for manifest in self._history:
      if manifest.fingerprint != fingerprint_:
        raise CheckpointMismatch(
            'the checkpoint holds another pipeline (its transforms differ '
            'from this one\'s): give this job another --checkpoint_location, '
            'or delete that one to start over')
    latest = self.latest
    self._files: dict = dict(latest.files) if latest else {}
    self._changed: dict = {}

  @property
  def latest(self) -> Optional[Manifest]:
    return self._history[-1] if self._history else None

  def file_of(self, key) -> Optional[str]:
    return self._files.get(key)

  def keys(self, *prefix) -> list:
    """The entries (as of the changes so far) whose key starts so."""
    files = dict(self._files)
    files.update(self._changed)
    return sorted(k for k, name in files.items()
                  if name is not None and k[:len(prefix)] == prefix)

  def live(self) -> set[str]:
    """Every file a kept manifest names."""
    return {name for m in self._history for name in _names(m.files)}

  def changed(self, key, file_name: Optional[str]) -> None:
    """``key``'s content is now in ``file_name`` (None: it has none)."""
    self._changed[key] = file_name

  def commit(self, batch: int, driver: dict) -> Manifest:
    """The manifest of ``batch``: the files as they are after it."""
    for key, name in self._changed.items():
      if name is None:
        self._files.pop(key, None)
      else:
        self._files[key] = name
    self._changed = {}
    manifest = Manifest(batch, self.fingerprint, dict(self._files), driver)
    self._history.append(manifest)
    return manifest

  def garbage(self) -> tuple[list[int], list[str]]:
    """(manifests, files) no kept manifest needs any more: all but the
    last KEEP_MANIFESTS manifests, and the files only they refer to."""
    old, kept = (self._history[:-KEEP_MANIFESTS],
                 self._history[-KEEP_MANIFESTS:])
    self._history = kept
    live = {name for m in kept for name in _names(m.files)}
    dead = {name for m in old for name in _names(m.files)} - live
    return [m.batch for m in old], sorted(dead)


def _names(files: dict) -> Iterable[str]:
  """The file names of a manifest's entries: one name, or a chain of them
  (a keyed partition's state, ``streaming.statestore``)."""
  for value in files.values():
    if isinstance(value, tuple):
      yield from value
    else:
      yield value
