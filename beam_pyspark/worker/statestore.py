"""Inside executors: a keyed partition's state chain, read and written under
the job's checkpoint location (the rules: ``streaming.statestore``).

A task loads its partition's entries from the chain the driver hands it,
from this Python worker's cache when it holds that very chain (the cached
entries are taken out while the task runs, so a task that fails leaves
nothing half changed behind), else from the files; after the wave it
writes a delta or a snapshot under a new name (whole or not at all: the
location's store, ``storage``, local, HDFS or an object store), and
reports the new chain. Every executor must see the location: a local
path on local Spark; shared storage, HDFS or an object store on a
cluster.
"""

from __future__ import annotations

import collections
import hashlib
import pickle
import posixpath
import threading
import uuid
from typing import Any
from typing import Optional
from typing import Union

from beam_pyspark.storage import Location
from beam_pyspark.streaming import statestore

# Partitions' states a Python worker keeps between tasks.
CACHED_PARTITIONS = 64

_cache: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def partition_dir(node: str, partition: int) -> str:
  """A partition's directory, relative to the checkpoint location."""
  digest = hashlib.sha1(node.encode('utf-8')).hexdigest()[:20]
  return posixpath.join('state', digest, str(partition))


class PartitionStore:
  """One keyed partition's state in one task.

  ``load()`` gives (entries, decoded): ``decoded`` is what the caller
  cached with them (objects decoded from the entries, None when they
  were read from files); ``save(entries, decoded)`` gives the new chain.
  """
  def __init__(self, root: Union[str, Location], job_id: str, node: str,
               partition: int, chain: Optional[tuple]):
    if isinstance(root, str):
      root = Location.parse(root)
    self.location = root
    self.root = root.url
    self.key = (job_id, node, partition)
    self.node, self.partition = node, partition
    self.chain = tuple(chain) if chain else None
    self._loaded: dict = {}

  def load(self) -> tuple[dict, Any]:
    if self.chain is None:
      self._loaded = {}
      return {}, None
    with _lock:
      cached = _cache.pop(self.key, None)
    if cached is not None and cached[0] == self.chain:
      _, entries, decoded = cached
    else:
      entries, decoded = statestore.replay(
          self._read(name) for name in self.chain), None
    self._loaded = entries
    return dict(entries), decoded

  def save(self, entries: dict, decoded: Any = None) -> Optional[tuple]:
    """Writes what changed since ``load()``; the partition's new chain
    (None: no state left)."""
    if not entries:
      return None
    record = statestore.next_record(self.chain, self._loaded, entries)
    chain = self.chain
    if record is not None:
      name = posixpath.join(
          partition_dir(self.node, self.partition), uuid.uuid4().hex)
      self.location.store().write(
          name, pickle.dumps(record, pickle.HIGHEST_PROTOCOL))
      chain = statestore.extend(self.chain, record, name)
    with _lock:
      _cache[self.key] = (chain, entries, decoded)
      _cache.move_to_end(self.key)
      while len(_cache) > CACHED_PARTITIONS:
        _cache.popitem(last=False)
    return chain

  def _read(self, name: str) -> statestore.Record:
    store = self.location.store()
    path = store.path(name)
    try:
      return pickle.loads(store.read(name))
    except FileNotFoundError:
      if not store.isdir('manifests'):
        # spark.checkpoints' layout: the driver's commits are gone too.
        raise RuntimeError(
            f'The job\'s checkpoint location {self.root} holds no committed '
            'micro-batch here: it was removed while the job ran, or this '
            'executor does not see it (on a cluster, set '
            '--checkpoint_location to storage every executor mounts). The '
            f'state of {self.node} (partition {self.partition}) cannot be '
            'read.') from None
      raise RuntimeError(
          f'The state of {self.node} (partition {self.partition}) is missing '
          f'its file {path}: every executor must see the job\'s checkpoint '
          'location (on a cluster, set --checkpoint_location to shared '
          'storage).') from None


def release(job_id: str) -> None:
  """Forgets the cached states of ``job_id`` in this Python worker."""
  with _lock:
    for key in [k for k in _cache if k[0] == job_id]:
      del _cache[key]

