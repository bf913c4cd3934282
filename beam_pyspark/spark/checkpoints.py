"""A streaming job's checkpoint directory: manifests and state files.

Layout under the job's checkpoint location (streaming.checkpoints says
what they hold):

    manifests/<batch>      one pickled Manifest per committed batch
    files/<batch>-<n>      a side input's contents, as of that batch
    state/<node>/<partition>/<name>
                           a keyed partition's state chain, written by
                           its tasks (worker.statestore)

File names (what manifests hold) are relative to the location.

The location is local, HDFS or an object store (``storage``): every file
is written whole or not at all (a temporary name and a rename, or one
PUT), so a driver killed while writing leaves no half file under a real
name; the manifest, written once and never replaced, is the batch's
commit. Files no manifest names (a batch
that died before its commit) are removed when the job resumes.

Each of the driver's calls to the store says what it is for
(``storage.doing``): a remote store that stops answering is reported in
the job's messages while the call waits ('has not answered for 30 s
committing the manifest of micro-batch 7'), and fails it after
``--checkpoint_store_timeout_secs`` a request (``remotestore``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import posixpath
import re
import shutil
import tempfile
from typing import Any
from typing import Callable
from typing import Optional
from typing import Union

from apache_beam.portability.api import beam_job_api_pb2

from beam_pyspark.errors import JobCancelledError
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.streaming.checkpoints import Manifest
from beam_pyspark.streaming.checkpoints import ManifestBook
from beam_pyspark.streaming.checkpoints import stage_key
from beam_pyspark.storage import KEEP
from beam_pyspark.storage import Location
from beam_pyspark.storage import Store
from beam_pyspark.storage import StoreTimeoutError
from beam_pyspark.storage import doing

# A side input's contents are committed batch by batch; past this many
# files they are rewritten as one (compaction).
MAX_SIDE_SEGMENTS = 16

_WARNING = beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_WARNING

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
  if isinstance(error, StoreTimeoutError) or not checkpoint.gone():
    # A store that timed out is not asked again (another wait as long):
    # what it holds is as the last committed micro-batch left it.
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
  def __init__(self, location: Union[str, Location], fingerprint_: str,
               stable_names: Optional[dict] = None,
               log: Optional[Callable[..., Any]] = None):
    """``log(text, importance)``: the job's messages, where a store call
    that runs long is reported (else Python's logging)."""
    self.dir = CheckpointDir(location, log)
    self.location = self.dir.location
    self.path = self.dir.path
    self._stable = dict(stable_names or {})
    self._local = {v: k for k, v in self._stable.items()}
    self.book = ManifestBook(fingerprint_, self.dir.manifests())
    self.dir.sweep(self.book.live())
    query, moved = self.location.query_checkpoint()
    if moved and self.book.latest is None:
      # Spark's own checkpoint kept on this disk from a job whose commits
      # are gone: it would resume batches this checkpoint never had.
      shutil.rmtree(query, ignore_errors=True)
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
    self.dir.remove(manifests, files, batch)

  def gone(self) -> bool:
    """Whether the checkpoint was removed under the job: its last
    committed manifest is missing. (Spark writes its own logs to the same
    location and makes the directory again, so the directory alone says
    nothing.) A store out of reach (HDFS, S3) is not gone: it may come
    back, and the job's own error says what failed."""
    latest, store = self.book.latest, self.dir.store
    try:
      with self.dir.doing('checking that the checkpoint is still there'):
        return not (store.exists(self.dir.manifest_name(latest.batch))
                    if latest is not None else store.isdir(_MANIFESTS))
    except Exception:  # pylint: disable=broad-except
      return False

  def delete(self) -> None:
    self.dir.delete()


class CheckpointDir:
  """The checkpoint's files, through the location's store (``storage``):
  local, HDFS or an object store alike."""
  def __init__(self, location: Union[str, Location],
               log: Optional[Callable[..., Any]] = None):
    if isinstance(location, str):
      location = Location.parse(location)
    self.location = location
    self.path = location.url
    self.store = location.store()
    self._log = log
    with self.doing('creating the checkpoint\'s directories'):
      self.store.makedirs(_MANIFESTS)
      self.store.makedirs(_FILES)
    self._written = 0

  def doing(self, what: str):
    """The store calls inside are for ``what`` (``storage.doing``); one
    that runs long is a WARNING in the job's messages."""
    log = self._log
    return doing(what, None if log is None else (
        lambda text: log(text, _WARNING)))

  def manifests(self) -> list[Manifest]:
    """The committed manifests, oldest first."""
    with self.doing('reading the committed manifests'):
      return _manifests(self.store)

  def write_file(self, batch: int, data: bytes) -> str:
    self._written += 1
    name = posixpath.join(_FILES, f'{batch}-{self._written}')
    with self.doing(f'writing the side inputs of micro-batch {batch}'):
      self.store.write(name, data)
    return name

  def read_file(self, name: str) -> bytes:
    with self.doing('reading the state the job resumes from'):
      return self.store.read(name)

  def manifest_name(self, batch: int) -> str:
    return posixpath.join(_MANIFESTS, str(batch))

  def manifest_path(self, batch: int) -> str:
    return self.store.path(self.manifest_name(batch))

  def commit(self, manifest: Manifest) -> None:
    """The batch's commit: its manifest, written once (a manifest of that
    batch already there was another driver's commit: this one fails)."""
    with self.doing(f'committing the manifest of micro-batch '
                    f'{manifest.batch}'):
      if not self.store.isdir(_MANIFESTS):
        raise PipelineExecutionError(
            f'The job\'s checkpoint location {self.path} is gone (removed '
            f'while the job ran?): micro-batch {manifest.batch} cannot '
            'commit.')
      self._commit(manifest)

  def _commit(self, manifest: Manifest) -> None:
    try:
      self.store.commit(
          self.manifest_name(manifest.batch),
          pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))
    except FileExistsError:
      raise PipelineExecutionError(
          f'Micro-batch {manifest.batch} was committed to {self.path} by '
          'another driver while this one ran it: two jobs (or two job '
          'servers) run this pipeline on one --checkpoint_location. This '
          'one stops; the other goes on.') from None

  def remove(self, batches: list[int], files: list[str],
             batch: Optional[int] = None) -> None:
    names = [*[self.manifest_name(b) for b in batches], *files]
    if not names:
      return
    with self.doing('removing what no kept manifest needs'
                    + (f' after micro-batch {batch}' if batch is not None
                       else '')):
      self.store.remove(*names)

  def sweep(self, live: set[str]) -> None:
    """Removes files no kept manifest names (and temporary ones)."""
    with self.doing('removing the files of a micro-batch that never '
                    'committed'):
      self.store.remove(*[
          self.manifest_name(name) for name in self.store.listdir(_MANIFESTS)
          if not name.isdigit() and name != KEEP])
      for top in (_FILES, _STATE):
        self.store.remove(*[
            name for name in self.store.files(top)
            if name not in live and posixpath.basename(name) != KEEP])

  def delete(self) -> None:
    with self.doing('removing the checkpoint of a job that ended'):
      self.store.rmtree()
    query, moved = self.location.query_checkpoint()
    if moved:  # Spark's own, kept on the driver's disk
      shutil.rmtree(query, ignore_errors=True)


def _manifests(store: Store) -> list[Manifest]:
  """The manifests committed under ``store``, oldest first (an unreadable
  one is left out: a manifest is only ever seen complete, so that is
  damage)."""
  found = []
  for name in store.listdir(_MANIFESTS):
    if not name.isdigit():
      continue
    try:
      found.append(pickle.loads(store.read(posixpath.join(_MANIFESTS, name))))
    except (OSError, pickle.UnpicklingError, EOFError):
      continue
  return sorted(found, key=lambda m: m.batch)


def last_committed(location: Location) -> Optional[int]:
  """The micro-batch a job resuming from the checkpoint at ``location``
  goes on after (engine.CHECKPOINTS): its latest readable manifest's;
  None if nothing committed there. Creates nothing, checks no
  fingerprint (the engine does, when it resumes)."""
  store = location.store()
  if not store.isdir(_MANIFESTS):
    return None
  found = _manifests(store)
  return found[-1].batch if found else None
