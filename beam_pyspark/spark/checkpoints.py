"""A streaming job's checkpoint directory: manifests and state files.

Layout under the job's checkpoint location (streaming.checkpoints says
what they hold):

    manifests/<batch>      one pickled Manifest per committed batch
    files/<batch>-<n>      a side input's contents, as of that batch
    state/<node>/<partition>/<name>
                           a keyed partition's state chain, written by
                           its tasks (worker.statestore)

File names (what manifests hold) are relative to the location.

Every file is written to a temporary name and renamed into place, so a
driver killed while writing leaves no half file under a real name; the
manifest's rename is the batch's commit. Files no manifest names (a batch
that died before its commit) are removed when the job resumes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import shutil
import tempfile
from typing import Callable
from typing import Optional

from beam_pyspark.errors import JobCancelledError
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.streaming.checkpoints import Manifest
from beam_pyspark.streaming.checkpoints import ManifestBook
from beam_pyspark.streaming.checkpoints import stage_key

# A side input's contents are committed batch by batch; past this many
# files they are rewritten as one (compaction).
MAX_SIDE_SEGMENTS = 16

_MANIFESTS = 'manifests'
_FILES = 'files'
_STATE = 'state'


def after_failure(checkpoint: 'JobCheckpoint', location: str,
                  error: BaseException, log: Callable[[str], None]) -> None:
  """What a failed job says of its checkpoint: where to resume from;
  unless it is gone, when its removal is most likely why the job failed
  (Spark's own commit fails first, 'File .../commits/.1.tmp does not
  exist'): then that is raised as the job's error, and no resume hint
  is given."""
  if not checkpoint.gone():
    log(f'The job\'s state as of its last committed micro-batch is kept in '
        f'{location}: run the same pipeline with this --checkpoint_location '
        'to resume from it.')
    return
  log(f'The job\'s checkpoint location {location} is gone, so nothing can '
      'resume the job: run the pipeline again to start it over.')
  if isinstance(error, Exception) and not isinstance(error, JobCancelledError):
    lines = [line for line in str(error).splitlines() if line.strip()]
    raise PipelineExecutionError(
        f'The job\'s checkpoint location {location} was removed while the '
        f'job ran, and the job cannot go on without it. The error: '
        f'{lines[0] if lines else type(error).__name__}') from error


def default_location(job_id: str) -> str:
  return os.path.join(tempfile.gettempdir(), 'beam-pyspark-checkpoints',
                      re.sub(r'[^A-Za-z0-9._-]', '_', job_id))


def stable_node_names(plan: ExecutionPlan) -> dict[str, str]:
  """The streaming engine's node names (stages by name, a TestStream's per
  tag) -> names that stay the same when the pipeline is fused again in
  another process; GroupByKey nodes are named by their buffer already."""
  names = {}
  for stage in plan.stages:
    key = stage_key(stage.transform_names)
    names[stage.name] = key
    for tag in stage.output_tags.values():
      names[f'{stage.name}#{tag}'] = f'{key}#{tag}'
  return names


# The engine's data keyed by node, renamed on the way in and out.
_BY_NODE = ('graph', 'next_event', 'next_processing', 'held', 'held_at')


@dataclasses.dataclass
class Resumed:
  """What a checkpoint's latest manifest restores."""
  batch: int
  driver: dict  # the engine's own plain data
  states: dict  # node -> partition -> state chain
  side_inputs: dict  # buffer id -> encoded chunks so far


class JobCheckpoint:
  """A streaming job's checkpoint: opened (files of a batch that never
  committed are swept), resumed from, committed to after each batch."""
  def __init__(self, path: str, fingerprint_: str,
               stable_names: Optional[dict] = None):
    self.dir = CheckpointDir(path)
    self.path = path
    self._stable = dict(stable_names or {})
    self._local = {v: k for k, v in self._stable.items()}
    self.book = ManifestBook(fingerprint_, self.dir.manifests())
    self.dir.sweep(self.book.live())
    self._dirty: set = set()  # (node, partition) changed since the commit
    self._state_files: set[str] = set()  # written since the commit
    self._side_committed: dict[bytes, int] = {}

  def stable_name(self, node: str) -> str:
    return self._stable.get(node, node)

  def local_name(self, node: str) -> str:
    return self._local.get(node, node)

  def resumed(self) -> Optional[Resumed]:
    latest, book = self.book.latest, self.book
    if latest is None:
      return None
    states: dict = {}
    for key in book.keys('state'):
      _, node, partition = key
      states.setdefault(self._local.get(node, node), {})[partition] = (
          book.file_of(key))
    side: dict = {}
    for key in book.keys('side'):
      side.setdefault(key[1], []).extend(
          pickle.loads(self.dir.read_file(book.file_of(key))))
    self._side_committed = {b: len(chunks) for b, chunks in side.items()}
    driver = dict(latest.driver)
    for field in _BY_NODE:
      driver[field] = {self._local.get(n, n): v
                       for n, v in driver[field].items()}
    return Resumed(latest.batch, driver, states, side)

  def state_changed(self, node: str, partition: int,
                    before: Optional[tuple], after: Optional[tuple]) -> None:
    """A keyed partition's state chain changed in a wave."""
    self._dirty.add((self._stable.get(node, node), partition))
    self._state_files.update(set(after or ()) - set(before or ()))

  def commit(self, batch: int, driver: dict, states: dict,
             side_inputs: dict) -> None:
    """Commits ``batch``: the side-input contents it added, the chains
    that changed, the engine's ``driver`` data, in a manifest renamed
    into place; then removes what no kept manifest names."""
    book = self.book
    states = {self._stable.get(n, n): v for n, v in states.items()}
    driver = dict(driver)
    for field in _BY_NODE:
      driver[field] = {self._stable.get(n, n): v
                       for n, v in driver[field].items()}
    for node, partition in sorted(self._dirty):
      book.changed(('state', node, partition),
                   states.get(node, {}).get(partition))
    self._dirty.clear()
    for buffer_id, chunks in sorted(side_inputs.items()):
      done = self._side_committed.get(buffer_id, 0)
      if len(chunks) == done:
        continue
      segments = book.keys('side', buffer_id)
      if len(segments) >= MAX_SIDE_SEGMENTS:
        for key in segments:
          book.changed(key, None)
        done = 0
      book.changed(('side', buffer_id, batch), self.dir.write_file(
          batch, pickle.dumps(chunks[done:], pickle.HIGHEST_PROTOCOL)))
      self._side_committed[buffer_id] = len(chunks)
    self.dir.commit(book.commit(batch, driver))
    manifests, files = book.garbage()
    # State files a later wave of the batch superseded.
    files.extend(self._state_files - book.live())
    self._state_files.clear()
    self.dir.remove(manifests, files)

  def gone(self) -> bool:
    """Whether the checkpoint was removed under the job: its last
    committed manifest is missing. (Spark writes its own logs to the same
    location and makes the directory again, so the directory alone says
    nothing.)"""
    latest = self.book.latest
    return not (os.path.isfile(self.dir.manifest_path(latest.batch))
                if latest is not None else
                os.path.isdir(os.path.join(self.path, _MANIFESTS)))

  def delete(self) -> None:
    self.dir.delete()


class CheckpointDir:
  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.join(path, _MANIFESTS), exist_ok=True)
    os.makedirs(os.path.join(path, _FILES), exist_ok=True)
    self._written = 0

  def manifests(self) -> list[Manifest]:
    """The committed manifests, oldest first."""
    return _manifests(self.path)

  def write_file(self, batch: int, data: bytes) -> str:
    self._written += 1
    name = os.path.join(_FILES, f'{batch}-{self._written}')
    self._write(os.path.join(self.path, name), data)
    return name

  def read_file(self, name: str) -> bytes:
    with open(os.path.join(self.path, name), 'rb') as f:
      return f.read()

  def manifest_path(self, batch: int) -> str:
    return os.path.join(self.path, _MANIFESTS, str(batch))

  def commit(self, manifest: Manifest) -> None:
    if not os.path.isdir(os.path.join(self.path, _MANIFESTS)):
      raise PipelineExecutionError(
          f'The job\'s checkpoint location {self.path} is gone (removed '
          f'while the job ran?): micro-batch {manifest.batch} cannot '
          'commit.')
    self._write(self.manifest_path(manifest.batch),
                pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))

  def remove(self, batches: list[int], files: list[str]) -> None:
    for batch in batches:
      _remove(os.path.join(self.path, _MANIFESTS, str(batch)))
    for name in files:
      _remove(os.path.join(self.path, name))

  def sweep(self, live: set[str]) -> None:
    """Removes files no kept manifest names (and temporary ones)."""
    for name in os.listdir(os.path.join(self.path, _MANIFESTS)):
      if not name.isdigit():
        _remove(os.path.join(self.path, _MANIFESTS, name))
    for top in (_FILES, _STATE):
      for directory, _, names in os.walk(os.path.join(self.path, top)):
        for name in names:
          path = os.path.join(directory, name)
          if os.path.relpath(path, self.path) not in live:
            _remove(path)

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


def _manifests(path: str) -> list[Manifest]:
  """The manifests committed under ``path``, oldest first (an unreadable
  one is left out: a manifest is only ever seen complete, so that is
  damage)."""
  found = []
  directory = os.path.join(path, _MANIFESTS)
  for name in os.listdir(directory):
    if not name.isdigit():
      continue
    try:
      with open(os.path.join(directory, name), 'rb') as f:
        found.append(pickle.load(f))
    except (OSError, pickle.UnpicklingError, EOFError):
      continue
  return sorted(found, key=lambda m: m.batch)


def last_committed(path: str) -> Optional[int]:
  """The micro-batch a job resuming from the checkpoint at ``path`` goes
  on after (engine.CHECKPOINTS): its latest readable manifest's; None if
  nothing committed there. Creates nothing, checks no fingerprint (the
  engine does, when it resumes)."""
  if not os.path.isdir(os.path.join(path, _MANIFESTS)):
    return None
  found = _manifests(path)
  return found[-1].batch if found else None


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass
