"""A streaming job's checkpoint directory: manifests and state files.

Layout under the job's checkpoint location (streaming.checkpoints says
what they hold):

    manifests/<batch>      one pickled Manifest per committed batch
    files/<batch>-<n>      one state entry's content as of that batch

Every file is written to a temporary name and renamed into place, so a
driver killed while writing leaves no half file under a real name; the
manifest's rename is the batch's commit. Files no manifest names (a batch
that died before its commit) are removed when the job resumes.
"""

from __future__ import annotations

import os
import pickle
import shutil

from beam_pyspark.streaming.checkpoints import Manifest

_MANIFESTS = 'manifests'
_FILES = 'files'


class CheckpointDir:
  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.join(path, _MANIFESTS), exist_ok=True)
    os.makedirs(os.path.join(path, _FILES), exist_ok=True)
    self._written = 0

  def manifests(self) -> list[Manifest]:
    """The committed manifests, oldest first (an unreadable one is left
    out: a manifest is only ever seen complete, so that is damage)."""
    found = []
    directory = os.path.join(self.path, _MANIFESTS)
    for name in os.listdir(directory):
      if not name.isdigit():
        continue
      try:
        with open(os.path.join(directory, name), 'rb') as f:
          found.append(pickle.load(f))
      except (OSError, pickle.UnpicklingError, EOFError):
        continue
    return sorted(found, key=lambda m: m.batch)

  def write_file(self, batch: int, data: bytes) -> str:
    self._written += 1
    name = f'{batch}-{self._written}'
    self._write(os.path.join(self.path, _FILES, name), data)
    return name

  def read_file(self, name: str) -> bytes:
    with open(os.path.join(self.path, _FILES, name), 'rb') as f:
      return f.read()

  def commit(self, manifest: Manifest) -> None:
    self._write(os.path.join(self.path, _MANIFESTS, str(manifest.batch)),
                pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))

  def remove(self, batches: list[int], files: list[str]) -> None:
    for batch in batches:
      _remove(os.path.join(self.path, _MANIFESTS, str(batch)))
    for name in files:
      _remove(os.path.join(self.path, _FILES, name))

  def sweep(self, live: set[str]) -> None:
    """Removes files no kept manifest names (and temporary ones)."""
    for directory in (_FILES, _MANIFESTS):
      for name in os.listdir(os.path.join(self.path, directory)):
        if directory == _FILES and name in live:
          continue
        if directory == _MANIFESTS and name.isdigit():
          continue
        _remove(os.path.join(self.path, directory, name))

  def delete(self) -> None:
    shutil.rmtree(self.path, ignore_errors=True)

  @staticmethod
  def _write(path: str, data: bytes) -> None:
    tmp = f'{path}.tmp-{os.getpid()}'
    with open(tmp, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass
