"""Staged artifacts on disk: content-addressed files and their writers.

``BlobStore`` keeps one flat directory of content-addressed files.
``ArtifactSink`` writes one artifact's chunks on a shared writer pool, and
``ByteBudget`` bounds the bytes received but not yet written.

Every artifact is written to a temporary file while its sha256 is computed,
then renamed to ``<sha256>-<hint>``: identical content is stored once, however
many jobs stage it, and each stored file counts the holders (staging attempts)
that reference it, so a job's removal deletes only what nobody else uses.

File names never come from the client unfiltered: the hint is the last
component of the artifact's name, reduced to ``[A-Za-z0-9._-]`` and clipped,
behind a hex digest, so no name can contain a separator, be ``..``, or leave
the root.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import re
import threading
import uuid
from typing import BinaryIO
from typing import Callable
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2

_LOGGER = logging.getLogger(__name__)

# Keeps names well under the 255-byte limit of common filesystems: a 64-char
# digest, a dash and at most this many ASCII characters.
MAX_HINT_CHARS = 100

PARTIAL_PREFIX = '.partial-'

# What this store names its files: committed (<sha256>-<hint>) and temporary.
_STORED_NAME = re.compile(r'^([0-9a-f]{64})-[A-Za-z0-9._-]+$')

_UNSAFE_CHARS = re.compile(r'[^A-Za-z0-9._-]+')
_SEPARATORS = re.compile(r'[/\\]')

FileWriter = Callable[[str], BinaryIO]


def default_file_writer(path: str) -> BinaryIO:
  # 'xb': a temporary name is fresh, so an existing file means a bug, not
  # something to overwrite.
  return open(path, 'xb')


def safe_hint(name: str) -> str:
  """A file-name fragment derived from an untrusted artifact name.

  Only the last path component survives (``../../etc/passwd`` -> ``passwd``),
  reduced to ASCII letters, digits, ``.``, ``_`` and ``-``; leading dots and
  dashes are dropped (no hidden files, nothing that reads as an option); the
  tail is kept when clipping, since the extension is what a reader needs.
  """
  parts = [
      p for p in _SEPARATORS.split(name.replace('\x00', ''))
      if p not in ('', '.', '..')
  ]
  hint = _UNSAFE_CHARS.sub('_', parts[-1]) if parts else ''
  hint = hint[-MAX_HINT_CHARS:].lstrip('.-')
  return hint or 'artifact'


def artifact_hint(artifact: beam_runner_api_pb2.ArtifactInformation) -> str:
  """The name a person would recognise the artifact by (still untrusted)."""
  try:
    if artifact.role_urn == common_urns.artifact_roles.STAGING_TO.urn:
      return beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(
          artifact.role_payload).staged_name
    if artifact.type_urn == common_urns.artifact_types.FILE.urn:
      return beam_runner_api_pb2.ArtifactFilePayload.FromString(
          artifact.type_payload).path
    if artifact.type_urn == common_urns.artifact_types.URL.urn:
      return beam_runner_api_pb2.ArtifactUrlPayload.FromString(
          artifact.type_payload).url
  except Exception:  # pylint: disable=broad-except
    # A malformed payload only costs us a nicer file name; the fetch itself
    # reports real problems.
    pass
  return 'artifact'


@dataclasses.dataclass(frozen=True)
class StoredBlob:
  """A committed artifact file."""
  path: str
  sha256: str
  size: int


@dataclasses.dataclass
class _Entry:
  path: str
  size: int
  holders: set[str]


class PendingBlob:
  """An artifact being written to its temporary file, hashed as it goes."""
  def __init__(self, path: str, handle: BinaryIO, hint: str):
    self.path = path
    self.hint = hint
    self._handle: Optional[BinaryIO] = handle
    self._hasher = hashlib.sha256()
    self.size = 0

  def write(self, data: bytes) -> None:
    assert self._handle is not None, 'write after close'
    self._handle.write(data)
    self._hasher.update(data)
    self.size += len(data)

  def close(self) -> None:
    handle, self._handle = self._handle, None
    if handle is not None:
      handle.close()

  def hexdigest(self) -> str:
    return self._hasher.hexdigest()


class BlobStore:
  """A flat directory of content-addressed files with reference counting.

  ``_entries`` (digest -> file) and ``_held`` (holder -> digests) are shared
  by every staging stream and the job service, so both are guarded by
  ``_lock``; renames and deletions happen under it too, which makes "is this
  content stored?" and "delete the last copy" atomic with respect to each
  other.
  """
  def __init__(self, root: str, file_writer: Optional[FileWriter] = None):
    os.makedirs(root, exist_ok=True)
    self.root = os.path.realpath(root)
    self._file_writer = file_writer or default_file_writer
    self._lock = threading.Lock()
    self._entries: dict[str, _Entry] = {}
    self._held: dict[str, set[str]] = {}

  def _path_in_root(self, name: str) -> str:
    path = os.path.join(self.root, name)
    # Defense in depth: safe_hint already makes this impossible.
    if (os.sep in name or '\x00' in name or name in ('.', '..') or
        os.path.dirname(path) != self.root):
      raise ValueError(f'Refusing artifact file name {name!r}')
    return path

  def create(self, name_hint: str) -> PendingBlob:
    """A new temporary file in the root, via the injected file writer."""
    path = self._path_in_root(PARTIAL_PREFIX + uuid.uuid4().hex)
    try:
      handle = self._file_writer(path)
    except BaseException:
      remove_quietly(path)
      raise
    return PendingBlob(path, handle, safe_hint(name_hint))

  def commit(self, blob: PendingBlob, holder: str) -> StoredBlob:
    """Moves a fully written blob to its content address, held by holder."""
    blob.close()
    digest = blob.hexdigest()
    with self._lock:
      entry = self._entries.get(digest)
      if entry is None:
        path = self._path_in_root(f'{digest}-{blob.hint}')
        os.replace(blob.path, path)
        entry = self._entries[digest] = _Entry(path, blob.size, set())
      else:
        # Same content already stored (perhaps under another hint): the
        # temporary copy is redundant.
        remove_quietly(blob.path)
      entry.holders.add(holder)
      self._held.setdefault(holder, set()).add(digest)
      return StoredBlob(entry.path, digest, entry.size)

  def hold(self, digest: str, holder: str) -> Optional[StoredBlob]:
    """The stored file of this content, now also held by holder; None if
    the store holds no such file.

    A client that names an artifact's sha256 need not send bytes the store
    already has. Taking the reference here, under the lock, keeps a
    concurrent ``release`` of another job from deleting the file between
    "it is stored" and "this job uses it".
    """
    with self._lock:
      entry = self._entries.get(digest)
      if entry is None:
        return None
      entry.holders.add(holder)
      self._held.setdefault(holder, set()).add(digest)
      return StoredBlob(entry.path, digest, entry.size)

  def discard(self, blob: PendingBlob) -> None:
    """Drops an unfinished blob; never raises, as it runs on error paths."""
    try:
      blob.close()
    except Exception:  # pylint: disable=broad-except
      # The write already failed; a failing close adds nothing the caller
      # can act on, and the file is removed below either way.
      _LOGGER.debug('Closing %s failed', blob.path, exc_info=True)
    remove_quietly(blob.path)

  def adopt(self, name: str, holder: str) -> StoredBlob:
    """Takes back a file an earlier process stored, held by holder.

    Raises FileNotFoundError if it is gone and ValueError if the name is not
    one this store gives.
    """
    match = _STORED_NAME.match(name)
    if match is None:
      raise ValueError(f'{name!r} is not a stored artifact name')
    digest = match.group(1)
    path = self._path_in_root(name)
    with self._lock:
      entry = self._entries.get(digest)
      if entry is None:
        size = os.stat(path).st_size
        entry = self._entries[digest] = _Entry(path, size, set())
      elif entry.path != path:
        raise ValueError(
            f'{name!r} duplicates the content of {entry.path!r}')
      entry.holders.add(holder)
      self._held.setdefault(holder, set()).add(digest)
      return StoredBlob(entry.path, digest, entry.size)

  def sweep(self) -> tuple[list[str], list[str]]:
    """Deletes this store's files that nobody holds, partial ones included.

    Meant for start-up, before anything is staged: a partial file then can
    only be an earlier process's. Entries this store did not name are left
    alone. Returns (deleted, left alone) names.
    """
    deleted, foreign = [], []
    with self._lock:
      held = {os.path.basename(e.path) for e in self._entries.values()}
      for name in sorted(os.listdir(self.root)):
        if name in held:
          continue
        path = os.path.join(self.root, name)
        ours = (
            _STORED_NAME.match(name) or name.startswith(PARTIAL_PREFIX)
        ) and os.path.isfile(path) and not os.path.islink(path)
        if ours:
          remove_quietly(path)
          deleted.append(name)
        else:
          foreign.append(name)
    return deleted, foreign

  def release(self, holder: str) -> int:
    """Forgets holder; deletes files nobody holds any more. Returns count."""
    deleted = 0
    with self._lock:
      for digest in self._held.pop(holder, ()):
        entry = self._entries[digest]
        entry.holders.discard(holder)
        if not entry.holders:
          del self._entries[digest]
          remove_quietly(entry.path)
          deleted += 1
    return deleted


# -- Writing while receiving --------------------------------------------------


class ByteBudget:
  """Bytes received but not yet written, across all streams.

  Unlike a plain semaphore, a chunk larger than the whole budget still gets
  through when nothing else is buffered, or it could never be staged; so the
  bound is max(limit, largest chunk).
  """
  def __init__(self, limit: int):
    self.limit = limit
    self._cond = threading.Condition()
    self._used = 0  # guarded by _cond
    self._peak = 0  # guarded by _cond

  def acquire(self, n: int, abandoned: Callable[[], bool]) -> bool:
    """Blocks until n bytes fit; False if abandoned() became true first."""
    with self._cond:
      while self._used and self._used + n > self.limit:
        if abandoned():
          return False
        self._cond.wait()
      if abandoned():
        return False
      self._used += n
      self._peak = max(self._peak, self._used)
      return True

  def release(self, n: int) -> None:
    if n:
      with self._cond:
        self._used -= n
        self._cond.notify_all()

  def wake(self) -> None:
    """Makes waiters re-check their abandoned() condition."""
    with self._cond:
      self._cond.notify_all()

  @property
  def used(self) -> int:
    with self._cond:
      return self._used

  @property
  def peak(self) -> int:
    with self._cond:
      return self._peak


class ArtifactSink:
  """One artifact on its way to disk.

  The stream's reader appends chunks; a task on the writer pool drains them
  in order. At most one drain task per sink is queued or running
  (``_scheduled``), so one artifact's chunks are written in order while
  different artifacts drain in parallel. A drain task never waits for the
  network: it ends when the queue is empty, and the next chunk schedules a
  new one. That keeps the shared pool and the shared budget free of
  deadlock: a writer thread parked on an artifact whose next chunk waits for
  budget, which waits for queued writes, would hold the pool hostage.
  """
  def __init__(
      self,
      store: BlobStore,
      writers: concurrent.futures.Executor,
      budget: ByteBudget,
      holder: str,
      environment: str,
      artifact: beam_runner_api_pb2.ArtifactInformation,
      on_failure: Callable[['ArtifactSink', BaseException], None]):
    self.environment = environment
    self.artifact = artifact
    self.name = artifact_hint(artifact)
    self.received = 0  # bytes put so far (the stream's reader only)
    self.result: concurrent.futures.Future[StoredBlob] = (
        concurrent.futures.Future())
    self._store = store
    self._writers = writers
    self._budget = budget
    self._holder = holder
    self._on_failure = on_failure
    self._lock = threading.Lock()
    self._chunks: collections.deque[bytes] = collections.deque()  # _lock
    self._closed = False  # _lock: every chunk has been put
    self._scheduled = False  # _lock: a drain task is queued or running
    self._cancelled: Optional[BaseException] = None  # _lock
    # Only touched by the one drain task in flight.
    self._blob: Optional[PendingBlob] = None

  def put(self, data: bytes) -> None:
    """Queues data, whose bytes the caller has acquired from the budget."""
    with self._lock:
      accepted = self._cancelled is None
      if accepted:
        self._chunks.append(data)
        start = self._claim_locked()
    if not accepted:
      self._budget.release(len(data))
    elif start:
      self._submit()

  def close(self) -> None:
    """No more chunks: commit once the queue is written."""
    with self._lock:
      self._closed = True
      start = self._claim_locked()
    if start:
      self._submit()

  def cancel(self, reason: BaseException) -> None:
    """Stops writing and removes the partial file; result fails."""
    with self._lock:
      if self._cancelled is not None or self.result.done():
        return
      self._cancelled = reason
      start = self._claim_locked()
    if start:
      # Nothing in flight: discard here rather than queue behind other
      # artifacts' writes, since discarding is quick.
      self._drain()

  def _claim_locked(self) -> bool:
    if self._scheduled:
      return False
    self._scheduled = True
    return True

  def _submit(self) -> None:
    try:
      self._writers.submit(self._drain)
    except RuntimeError as exn:  # the pool was shut down: service closed
      self._fail(exn)
      self._drain()

  def _fail(self, exn: BaseException) -> None:
    # The stream learns of the failure before the result does, so whoever
    # waits on results finds the stream already failed.
    self._on_failure(self, exn)
    with self._lock:
      if self._cancelled is None:
        self._cancelled = exn

  def _drain(self) -> None:
    while True:
      with self._lock:
        if self._cancelled is not None:
          dropped = sum(map(len, self._chunks))
          self._chunks.clear()
          cancelled = self._cancelled
          action = 'discard'
        elif self._chunks:
          chunk = self._chunks.popleft()
          action = 'write'
        elif self._closed:
          action = 'commit'
        else:
          self._scheduled = False
          return
      if action == 'discard':
        # _scheduled stays set: nothing is left to do for this sink.
        self._budget.release(dropped)
        if self._blob is not None:
          self._store.discard(self._blob)
          self._blob = None
        if not self.result.done():
          self.result.set_exception(cancelled)
        return
      try:
        if self._blob is None:
          # Opened here, not by the reader: opening is disk I/O too, and a
          # failing file writer then takes the same path as a failing write.
          self._blob = self._store.create(self.name)
        if action == 'write':
          try:
            self._blob.write(chunk)
          finally:
            self._budget.release(len(chunk))
        else:
          stored = self._store.commit(self._blob, self._holder)
          self._blob = None
          self.result.set_result(stored)
          return
      except Exception as exn:  # pylint: disable=broad-except
        # Any error ends the artifact; the next turn discards the file.
        self._fail(exn)


def remove_quietly(path: str) -> None:
  """Removes ``path``; gone already is fine, anything else is logged."""
  try:
    os.remove(path)
  except FileNotFoundError:
    pass
  except OSError:
    _LOGGER.warning('Could not remove %s', path, exc_info=True)
