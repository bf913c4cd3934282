"""Where a streaming job's checkpoint lives: one file-system layer for the
driver and the executors' Python workers alike.

A ``--checkpoint_location`` is a local path (or ``file://``), ``hdfs://``,
``webhdfs://``, ``s3://`` (``s3a://``, any S3-compatible endpoint) or
``gs://``. ``Location.parse`` names it, ``Location.store()`` opens it
(once per process, so a Python worker's tasks share the client), and a
``Store`` reads and writes names relative to it with the guarantees the
checkpoint needs (``spark.checkpoints``, ``worker.statestore``):

* ``write(name, data)``: all of ``data`` or nothing appears under
  ``name``. Local and HDFS: a temporary name, then a rename (atomic
  there; local files are fsynced first). Object stores: one PUT, which S3
  and GCS make visible whole or not at all.
* ``commit(name, data)``: as ``write``, and refused (``FileExistsError``)
  when ``name`` exists: a manifest is the batch's single commit point, so
  a second driver (a zombie after a restart) cannot overwrite the one
  that committed first. Local: a hard link of the temporary file; HDFS:
  its rename, which never replaces; S3: a conditional PUT
  (``If-None-Match: *``), GCS: ``ifGenerationMatch=0``.

Local paths use ``os`` directly, as before this layer (fsspec's local
file system neither fsyncs nor renames atomically, and costs more per
call; measurements in docs/checkpoint-storage.md); every other scheme
goes through fsspec, installed with the package's extra for it
(``beam-pyspark[hdfs]``, ``[s3]``, ``[gcs]``): a scheme whose library is
missing is refused when the job is submitted, naming that extra.

HDFS from Python is WebHDFS (pure Python: no libhdfs, no JVM in every
Python worker): ``hdfs://namenode:8020/path`` is reached at
``--hdfs_host`` (default the namenode's host) and ``--hdfs_port`` (the
NameNode's HTTP port, default 9870) as ``--hdfs_user``, Beam's own
options for its HDFS file system; Spark's JVM writes its query checkpoint
to the ``hdfs://`` URL itself. S3 takes Beam's ``--s3_endpoint_url``,
``--s3_region_name``, ``--s3_access_key_id``,
``--s3_secret_access_key``, ``--s3_verify`` (else botocore's own
environment and configuration).

A store that stops answering (a frozen server, a half-open connection)
fails the call instead of hanging it: every request has
``--checkpoint_store_timeout_secs`` (``DEFAULT_STORE_TIMEOUT_SECS``) to
connect and to answer (S3: botocore's connect and read timeouts, one
retry; WebHDFS: requests' timeout on the session; GCS: gcsfs's
``requests_timeout``), and the error (``StoreTimeoutError``) names the
store, the file and what the caller was doing (``doing``). A call still
running after that long is reported while it runs (``remotestore``,
which holds the fsspec stores), so a job waiting on its store says so
(an S3 server frozen for 6 minutes used to leave the job silent for 6
minutes, then FAILED).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import posixpath
import tempfile
import threading
import urllib.parse
import uuid
from typing import Callable
from typing import Iterator
from typing import Optional

from beam_pyspark.errors import InvalidOptionsError
from beam_pyspark.errors import PipelineExecutionError

# scheme -> (fsspec protocol, the package's extra, the modules it needs).
REMOTE_SCHEMES = {
    'hdfs': ('webhdfs', 'hdfs', ('fsspec', 'requests')),
    'webhdfs': ('webhdfs', 'hdfs', ('fsspec', 'requests')),
    's3': ('s3', 's3', ('fsspec', 's3fs')),
    's3a': ('s3', 's3', ('fsspec', 's3fs')),
    'gs': ('gcs', 'gcs', ('fsspec', 'gcsfs')),
}
# Schemes whose names Spark's JVM (the Hadoop client pyspark bundles) can
# keep the query's own checkpoint under; for the others it stays on the
# driver's disk (``Location.query_checkpoint``).
SPARK_SCHEMES = ('file', 'hdfs', 'webhdfs')
DEFAULT_WEBHDFS_PORT = 9870
# Beam's own pipeline options for its HDFS and S3 file systems.
STORAGE_OPTIONS = ('hdfs_host', 'hdfs_port', 'hdfs_user', 's3_endpoint_url',
                   's3_region_name', 's3_access_key_id',
                   's3_secret_access_key', 's3_session_token', 's3_verify',
                   's3_disable_ssl', 'checkpoint_store_timeout_secs')
# A request to a remote store with no answer for this long fails (and a
# call running this long is reported): S3's own SDK waits 60 s per read
# and retries 3 to 5 times, minutes in all; a checkpoint's requests are
# small (a manifest, a keyed partition's state), so 30 s without a byte
# is a store in trouble, not a slow one.
DEFAULT_STORE_TIMEOUT_SECS = 30.0


def store_timeout(options: dict) -> float:
  """``--checkpoint_store_timeout_secs`` among storage options."""
  value = options.get('checkpoint_store_timeout_secs')
  if value in (None, ''):
    return DEFAULT_STORE_TIMEOUT_SECS
  try:
    secs = float(value)
  except ValueError:
    secs = -1
  if not secs > 0:
    raise InvalidOptionsError([
        f'--checkpoint_store_timeout_secs={value}: give the seconds (above '
        '0) a request to the checkpoint store may go unanswered.'])
  return secs


def storage_options(job_options: Optional[dict]) -> dict:
  """Beam's HDFS and S3 options among a job's (``beam:option:NAME:v1``
  keys, as ``RunnerOptions.job_options`` holds them)."""
  found = {}
  for name in STORAGE_OPTIONS:
    value = (job_options or {}).get(f'beam:option:{name}:v1')
    if value not in (None, ''):
      found[name] = value
  return found


@dataclasses.dataclass(frozen=True)
class Location:
  """A checkpoint location: ``url`` as messages show it (a local one is
  its absolute path), its scheme, and the storage options reaching it."""
  url: str
  scheme: str  # 'file' or a key of REMOTE_SCHEMES
  options: tuple = ()  # sorted (name, value) pairs

  @classmethod
  def parse(cls, location: str, options: Optional[dict] = None) -> 'Location':
    """``--checkpoint_location`` named: raises InvalidOptionsError naming
    the option for a scheme this runner does not write, or one whose
    library is not installed (naming the extra to install)."""
    option = f'--checkpoint_location={location}'
    parts = urllib.parse.urlsplit(location)
    scheme = parts.scheme.lower()
    if len(scheme) == 1 and os.name == 'nt':  # a drive letter
      scheme = ''
    if scheme in ('', 'file'):
      path = location
      if scheme == 'file':
        if parts.netloc not in ('', 'localhost'):
          raise InvalidOptionsError([
              f'{option}: a file URL names a local path (file:///path), not '
              f'host {parts.netloc!r}.'])
        path = urllib.parse.unquote(parts.path)
      return cls(os.path.abspath(os.path.expanduser(path)), 'file')
    if scheme not in REMOTE_SCHEMES:
      raise InvalidOptionsError([
          f'{option}: streaming checkpoints cannot go to {scheme}://; give '
          'a local path or file:///path (on a cluster, a mount every node '
          'shares), hdfs://, webhdfs://, s3:// or gs://.'])
    _, extra, modules = REMOTE_SCHEMES[scheme]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
      raise InvalidOptionsError([
          f'{option}: checkpoints on {scheme}:// need '
          f'{" and ".join(missing)}, not installed here: install '
          f'beam-pyspark[{extra}] (pip install "beam-pyspark[{extra}]") on '
          'the driver and every executor.'])
    if not parts.netloc:
      raise InvalidOptionsError([
          f'{option}: a {scheme}:// location names its '
          f'{"bucket" if scheme in ("s3", "s3a", "gs") else "namenode"}: '
          f'{scheme}://HOST/path.'])
    url = urllib.parse.urlunsplit(
        (scheme, parts.netloc, parts.path.rstrip('/'), '', ''))
    store_timeout(options or {})  # refused here, at submission
    return cls(url, scheme, tuple(sorted((options or {}).items())))

  @property
  def local(self) -> Optional[str]:
    """The local path, for a local location; else None."""
    return self.url if self.scheme == 'file' else None

  def store(self) -> 'Store':
    """This location's store, shared within the process."""
    with _lock:
      store = _stores.get(self)
      if store is None:
        store = _stores[self] = (LocalStore(self.url) if self.scheme == 'file'
                                 else _remote(self))
      return store

  def query_checkpoint(self) -> tuple[str, Optional[str]]:
    """Where Spark's own query checkpoint (offsets, commits) goes, and,
    when that is not under this location, why. Spark's JVM writes it
    through Hadoop's FileSystem: local paths and hdfs:// (the client
    pyspark bundles) go under the location; s3:// would need s3a, that
    is hadoop-aws and the AWS SDK on Spark's classpath (the SDK's
    bundle alone is several hundred MB), gs:// Google's connector: for
    those it stays on the driver's disk, and a driver that resumes
    without it goes on from the runner's own manifests
    (``spark.sources``)."""
    if self.scheme in SPARK_SCHEMES:
      return self.join('query'), None
    digest = hashlib.sha256(self.url.encode('utf-8')).hexdigest()[:20]
    local = os.path.join(tempfile.gettempdir(), 'beam-pyspark-queries',
                         digest)
    return local, (
        f'Spark\'s own query checkpoint (its offset and commit logs) is kept '
        f'on the driver\'s disk at {local}: Spark\'s JVM cannot write to '
        f'{self.scheme}:// without its connector (s3a: hadoop-aws and the '
        'AWS SDK) on its classpath. The job\'s state and commits are in '
        f'{self.url}; a driver started elsewhere resumes from them.')

  def join(self, *names: str) -> str:
    if self.scheme == 'file':
      return os.path.join(self.url, *names)
    return posixpath.join(self.url, *names)

  def __repr__(self) -> str:  # never the options: they may hold secrets
    return f'Location({self.url!r})'


_lock = threading.Lock()
_stores: dict = {}


def _remote(location: 'Location') -> 'Store':
  # Not imported with this module: fsspec is only for remote locations.
  # pylint: disable-next=import-outside-toplevel
  from beam_pyspark.remotestore import FsspecStore
  return FsspecStore(location)


class StoreTimeoutError(PipelineExecutionError):
  """A checkpoint store that did not answer in time. Not an OSError:
  callers that take an OSError for a damaged or missing file (an
  unreadable manifest is skipped) must not take a silent store for one."""


_doing = threading.local()


@contextlib.contextmanager
def doing(what: str, warn: Optional[Callable[[str], None]] = None
         ) -> Iterator[None]:
  """What the store calls this thread makes inside are for ('committing
  the manifest of micro-batch 3'), said in their errors and in reports of
  calls that run long, and where those reports go (``warn``: the job's
  messages; else Python's logging, which executors forward)."""
  previous = getattr(_doing, 'current', None)
  _doing.current = (what, warn)
  try:
    yield
  finally:
    _doing.current = previous


def purpose() -> tuple[Optional[str], Optional[Callable[[str], None]]]:
  """(what, warn) of the innermost ``doing`` of this thread."""
  return getattr(_doing, 'current', None) or (None, None)


def checked(location: str, options: Optional[dict] = None) -> Location:
  """``Location.parse``, then checked at submission: a location this
  process can create and write to. Raises InvalidOptionsError naming the
  option (hdfs://namenode:8020/ckpt used to make a local directory
  './hdfs:/namenode:8020/ckpt' and fail 19 s later)."""
  parsed = Location.parse(location, options)
  try:
    store = parsed.store()
    store.makedirs('')
    probe = f'.write-check-{uuid.uuid4().hex}'
    store.write(probe, b'')
    store.remove(probe)
  except Exception as exn:  # pylint: disable=broad-except
    # OSError, and each library's own (botocore's, requests').
    reason = getattr(exn, 'strerror', None) or str(exn) or ''
    reason = reason.strip().splitlines()[0] if reason.strip() else ''
    raise InvalidOptionsError([
        f'--checkpoint_location={location}: cannot create or write to '
        f'{parsed.url} ({type(exn).__name__}: {reason[:300]}); give a '
        'location this process can create and write to'
        + ('.' if parsed.scheme == 'file' else
           ' (and the options that reach it: --hdfs_host, --hdfs_port, '
           '--hdfs_user for WebHDFS; --s3_endpoint_url, --s3_region_name '
           'and credentials for S3).')]) from None
  return parsed


class Store:
  """Names relative to a checkpoint location ('/'-separated)."""
  url: str

  def read(self, name: str) -> bytes:
    """Raises FileNotFoundError when ``name`` is missing."""
    raise NotImplementedError

  def write(self, name: str, data: bytes) -> None:
    raise NotImplementedError

  def commit(self, name: str, data: bytes) -> None:
    raise NotImplementedError

  def exists(self, name: str) -> bool:
    raise NotImplementedError

  def isdir(self, name: str) -> bool:
    raise NotImplementedError

  def listdir(self, name: str) -> list[str]:
    """Names directly under directory ``name`` ([] when there is none)."""
    raise NotImplementedError

  def files(self, name: str) -> list[str]:
    """Every file under directory ``name``, relative to the location."""
    raise NotImplementedError

  def makedirs(self, name: str) -> None:
    raise NotImplementedError

  def remove(self, *names: str) -> None:
    """Removes files; a missing one is no error."""
    raise NotImplementedError

  def rmtree(self) -> None:
    """Removes the location and everything under it, quietly."""
    raise NotImplementedError

  def path(self, name: str) -> str:
    """``name`` as a full path or URL, for messages."""
    return posixpath.join(self.url, name) if name else self.url


class LocalStore(Store):
  """A local (or mounted) directory, through ``os``."""
  def __init__(self, root: str):
    self.url = self.root = root

  def path(self, name: str) -> str:
    return os.path.join(self.root, name) if name else self.root

  def read(self, name: str) -> bytes:
    with open(self.path(name), 'rb') as f:
      return f.read()

  def write(self, name: str, data: bytes) -> None:
    path = self.path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.replace(self._temporary(path, data), path)

  def commit(self, name: str, data: bytes) -> None:
    path = self.path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = self._temporary(path, data)
    try:
      os.link(tmp, path)  # atomic, and never replaces
    except FileExistsError:
      raise
    except OSError:  # a file system without hard links
      os.replace(tmp, path)
      return
    finally:
      _quiet_remove(tmp)

  @staticmethod
  def _temporary(path: str, data: bytes) -> str:
    tmp = f'{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}'
    with open(tmp, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    return tmp

  def exists(self, name: str) -> bool:
    return os.path.exists(self.path(name))

  def isdir(self, name: str) -> bool:
    return os.path.isdir(self.path(name))

  def listdir(self, name: str) -> list[str]:
    try:
      return os.listdir(self.path(name))
    except (FileNotFoundError, NotADirectoryError):
      return []

  def files(self, name: str) -> list[str]:
    found = []
    for directory, _, names in os.walk(self.path(name)):
      found.extend(os.path.relpath(os.path.join(directory, n), self.root)
                   for n in names)
    return found

  def makedirs(self, name: str) -> None:
    os.makedirs(self.path(name), exist_ok=True)

  def remove(self, *names: str) -> None:
    for name in names:
      _quiet_remove(self.path(name))

  def rmtree(self) -> None:
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(self.root, ignore_errors=True)


def _quiet_remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass


# The marker object that makes an object store's "directory" exist.
KEEP = '.keep'
