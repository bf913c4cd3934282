"""A checkpoint location on HDFS (WebHDFS), S3 or GCS, through fsspec
(``storage`` says what a store guarantees and how each is reached).

Every request has ``--checkpoint_store_timeout_secs`` to connect and to
answer, and every call is watched: one still running after that long is
reported while it runs (``storage.doing`` says to whom, and what it is
for), one whose request timed out raises ``storage.StoreTimeoutError``
naming the store, the file and the purpose. A frozen S3 server (SIGSTOP
for 6 minutes) used to leave a job silent for those 6 minutes, every
request waiting on botocore's 60 s read timeout, retried by botocore and
again by s3fs; WebHDFS's requests had no timeout at all.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import posixpath
import threading
import time
import urllib.parse
import uuid
from typing import Callable
from typing import Iterator
from typing import Optional

from beam_pyspark import storage

_LOGGER = logging.getLogger(__name__)


class _Watchdog:
  """Reports store calls still running after their store's timeout, and
  again after each further timeout: one daemon thread per process,
  started with the first call (so after a fork, too)."""
  def __init__(self):
    self._lock = threading.Lock()
    self._calls: dict = {}  # key -> [next report, every, started, say, warn]
    self._keys = itertools.count()
    self._thread: Optional[threading.Thread] = None

  def add(self, every: float, say: Callable[[float], str],
          warn: Callable[[str], None]) -> int:
    now = time.monotonic()
    with self._lock:
      key = next(self._keys)
      self._calls[key] = [now + every, every, now, say, warn]
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(
            target=self._run, name='checkpoint-store-watchdog', daemon=True)
        self._thread.start()
    return key

  def remove(self, key: int) -> None:
    with self._lock:
      self._calls.pop(key, None)

  def _run(self) -> None:
    while True:
      time.sleep(0.5)
      now, due = time.monotonic(), []
      with self._lock:
        for call in self._calls.values():
          if call[0] <= now:
            call[0] = now + call[1]
            due.append((call[3](now - call[2]), call[4]))
      for text, warn in due:  # outside the lock: warn may block
        try:
          warn(text)
        except Exception:  # pylint: disable=broad-except
          _LOGGER.warning('%s', text)


_WATCHDOG = _Watchdog()
# Exceptions that mean "no answer in time", by name: botocore's and
# urllib3's ReadTimeoutError, ConnectTimeoutError, requests' Timeout,
# ReadTimeout, ConnectTimeout, fsspec's FSTimeoutError, aiohttp's
# ServerTimeoutError (none of which this module imports).
_TIMEOUT_NAMES = frozenset((
    'TimeoutError', 'ReadTimeoutError', 'ConnectTimeoutError', 'Timeout',
    'ReadTimeout', 'ConnectTimeout', 'FSTimeoutError', 'ServerTimeoutError'))


def _timed_out(exn: BaseException) -> bool:
  seen = 0
  while exn is not None and seen < 6:
    if any(c.__name__ in _TIMEOUT_NAMES for c in type(exn).__mro__):
      return True
    exn, seen = exn.__cause__ or exn.__context__, seen + 1
  return False


class FsspecStore(storage.Store):
  """HDFS (WebHDFS), S3 or GCS through fsspec."""
  def __init__(self, location: storage.Location):
    import fsspec  # pylint: disable=import-outside-toplevel
    self.url = location.url
    self.scheme = location.scheme
    parts = urllib.parse.urlsplit(location.url)
    options = dict(location.options)
    self.object_store = self.scheme in ('s3', 's3a', 'gs')
    if self.object_store:
      self.root = f'{parts.netloc}{parts.path}'
    else:
      self.root = parts.path or '/'
    protocol = storage.REMOTE_SCHEMES[self.scheme][0]
    self.timeout = storage.store_timeout(options)
    fs_options = _fsspec_options(self.scheme, parts, options)
    self.fs = fsspec.filesystem(protocol, skip_instance_cache=True,
                                **fs_options)
    # Where the store is, for messages: the URL, and the endpoint that
    # answers for it when the URL does not say.
    self.where = self.url
    if self.scheme in ('hdfs', 'webhdfs'):
      self.where += (f' (WebHDFS at {fs_options["host"]}:'
                     f'{fs_options["port"]})')
      _bound_requests(self.fs.session, self.timeout)
    if self.scheme in ('s3', 's3a'):
      # s3fs tries each call 5 times (a class attribute, not an argument),
      # each with botocore's attempts: minutes for a frozen server.
      # botocore's attempts are enough.
      self.fs.retries = 1
    # Object stores (s3fs, gcsfs: fsspec's async file systems) also get a
    # deadline for each call as a whole, enforced by fsspec's sync(): a
    # PUT waits for S3's '100 Continue' with no read timeout at all
    # (aiohttp's expect100 wait; seen with moto frozen by SIGSTOP), so
    # the request timeouts alone let a commit hang for ever. Generous, so
    # that a large state file still uploads: 4 requests' worth.
    self._call = ({'timeout': 4 * self.timeout}
                  if getattr(self.fs, 'async_impl', False) else {})
    if fs_options.get('client_kwargs', {}).get('endpoint_url'):
      self.where += f' (endpoint {fs_options["client_kwargs"]["endpoint_url"]})'

  @contextlib.contextmanager
  def _io(self, action: str, name: str) -> Iterator[None]:
    """One call to the store: reported while it runs past the timeout,
    and its timeout raised as a StoreTimeoutError that names the store,
    the file and what the caller was doing (``doing``)."""
    purpose, warn = storage.purpose()
    text = f'{action} {self.path(name)}' + (f' ({purpose})' if purpose else '')
    key = _WATCHDOG.add(self.timeout, lambda secs: (
        f'The checkpoint store {self.where} has not answered for '
        f'{secs:.0f} s {text}; still waiting (each request to it fails '
        f'after {self.timeout:g} s without an answer: '
        '--checkpoint_store_timeout_secs).'), warn or _LOGGER.warning)
    try:
      yield
    except storage.StoreTimeoutError:
      raise
    except Exception as exn:
      if not _timed_out(exn):
        raise
      reason = str(exn).strip().splitlines()
      raise storage.StoreTimeoutError(
          f'The checkpoint store {self.where} did not answer within '
          f'{self.timeout:g} s (--checkpoint_store_timeout_secs) {text}: '
          f'{type(exn).__name__}'
          f'{": " + reason[0][:300] if reason else ""}. Check that it is up '
          'and reachable from this host; the job\'s state as of its last '
          'committed micro-batch stays there, and the same pipeline with the '
          'same --checkpoint_location resumes from it.') from exn
    finally:
      _WATCHDOG.remove(key)

  def _full(self, name: str) -> str:
    return posixpath.join(self.root, name) if name else self.root

  def read(self, name: str) -> bytes:
    with self._io('reading', name):
      return self.fs.cat_file(self._full(name), **self._call)

  def write(self, name: str, data: bytes) -> None:
    path = self._full(name)
    with self._io('writing', name):
      if self.object_store:
        self.fs.pipe_file(path, data, **self._call)
        return
      tmp = f'{path}.tmp-{uuid.uuid4().hex}'
      self.fs.pipe_file(tmp, data, **self._call)
      if not self._rename(tmp, path):  # HDFS renames never replace
        self.fs.rm_file(path, **self._call)
        if not self._rename(tmp, path):
          raise OSError(f'could not rename {tmp} to {path}')

  def commit(self, name: str, data: bytes) -> None:
    path = self._full(name)
    with self._io('committing', name):
      if self.object_store:
        self.fs.pipe_file(path, data, mode='create', **self._call)
        return
      tmp = f'{path}.tmp-{uuid.uuid4().hex}'
      self.fs.pipe_file(tmp, data, **self._call)
      if not self._rename(tmp, path):
        self._remove_quietly(tmp)
        raise FileExistsError(f'{self.path(name)} exists already')

  def _rename(self, src: str, dst: str) -> bool:
    """WebHDFS's RENAME: whether it renamed (false when ``dst`` exists;
    fsspec's ``mv`` drops that answer)."""
    answer = self.fs._call(  # pylint: disable=protected-access
        'RENAME', method='put', path=src, destination=dst)
    return bool(answer.json().get('boolean'))

  # fsspec's own exists() and isdir() answer False for any error: a store
  # out of reach would read as a checkpoint that is gone.
  def _info(self, name: str) -> Optional[dict]:
    with self._io('looking up', name):
      return self._info_unwatched(name)

  def _info_unwatched(self, name: str) -> Optional[dict]:
    try:
      return self.fs.info(self._full(name), **self._call)
    except FileNotFoundError:
      return None

  def exists(self, name: str) -> bool:
    return self._info(name) is not None

  def isdir(self, name: str) -> bool:
    info = self._info(name)
    return info is not None and info.get('type') == 'directory'

  def listdir(self, name: str) -> list[str]:
    with self._io('listing', name):
      try:
        found = self.fs.ls(self._full(name), detail=False, **self._call)
      except (FileNotFoundError, NotADirectoryError):
        return []
    return [posixpath.basename(p.rstrip('/')) for p in found]

  def files(self, name: str) -> list[str]:
    base = self.root.rstrip('/') + '/'
    with self._io('listing', name):
      try:
        found = self.fs.find(self._full(name), **self._call)
      except FileNotFoundError:
        return []
    return [p[len(base):] for p in found if p.startswith(base)]

  def makedirs(self, name: str) -> None:
    with self._io('creating', name):
      if self.object_store:
        # Object stores have no directories: a marker object makes the
        # prefix exist, so that a location made at submission is there.
        marker = posixpath.join(name, storage.KEEP) if name else storage.KEEP
        if self._info_unwatched(marker) is None:
          self.fs.pipe_file(self._full(marker), b'', **self._call)
        return
      self.fs.makedirs(self._full(name), exist_ok=True)

  def remove(self, *names: str) -> None:
    with self._io('removing', names[0] if len(names) == 1 else
                  f'{len(names)} files under'):
      if self.object_store and len(names) > 1:
        # One request for them all (S3's DeleteObjects; a missing key is
        # no error there).
        try:
          self.fs.rm([self._full(n) for n in names], **self._call)
        except FileNotFoundError:
          pass
        return
      for name in names:
        self._remove_quietly(self._full(name))

  def _remove_quietly(self, path: str) -> None:
    try:
      self.fs.rm_file(path, **self._call)
    except FileNotFoundError:
      pass

  def rmtree(self) -> None:
    with self._io('removing', ''):
      try:
        self.fs.rm(self.root, recursive=True, **self._call)
      except (FileNotFoundError, OSError):
        pass




def _fsspec_options(scheme: str, parts, options: dict) -> dict:
  if scheme in ('hdfs', 'webhdfs'):
    host = options.get('hdfs_host') or parts.hostname
    if scheme == 'webhdfs':
      port = (parts.port or options.get('hdfs_port') or
              storage.DEFAULT_WEBHDFS_PORT)
    else:  # the URL's port is the NameNode's RPC port, Spark's
      port = options.get('hdfs_port') or storage.DEFAULT_WEBHDFS_PORT
    found = {'host': host, 'port': int(port)}
    if options.get('hdfs_user'):
      found['user'] = options['hdfs_user']
    return found
  if scheme in ('s3', 's3a'):
    client = {}
    if options.get('s3_endpoint_url'):
      client['endpoint_url'] = options['s3_endpoint_url']
    if options.get('s3_region_name'):
      client['region_name'] = options['s3_region_name']
    if str(options.get('s3_verify', '')).lower() in ('false', '0'):
      client['verify'] = False
    timeout = storage.store_timeout(options)
    found = {'client_kwargs': client,
             # Listings from other processes (the source reader's) must
             # see new manifests: no listing cache.
             'use_listings_cache': False,
             # A request without an answer fails after the timeout and is
             # tried once more (botocore's standard mode, which also backs
             # off when throttled); s3fs's own retries: FsspecStore.
             'config_kwargs': {
                 'connect_timeout': timeout, 'read_timeout': timeout,
                 'retries': {'mode': 'standard', 'total_max_attempts': 2}}}
    if options.get('s3_access_key_id'):
      found['key'] = options['s3_access_key_id']
      found['secret'] = options.get('s3_secret_access_key')
    if options.get('s3_session_token'):
      found['token'] = options['s3_session_token']
    if str(options.get('s3_disable_ssl', '')).lower() in ('true', '1'):
      found['use_ssl'] = False
    return found
  if scheme == 'gs':
    return {'requests_timeout': storage.store_timeout(options)}
  return {}


def _bound_requests(session, timeout: float) -> None:
  """Gives every request of a requests ``session`` (fsspec's WebHDFS
  passes none) ``timeout`` seconds to connect and to answer."""
  import requests.adapters  # pylint: disable=import-outside-toplevel

  class Bounded(requests.adapters.HTTPAdapter):
    def send(self, request, **kwargs):  # pylint: disable=arguments-differ
      if kwargs.get('timeout') is None:
        kwargs['timeout'] = timeout
      return super().send(request, **kwargs)

  for prefix in ('http://', 'https://'):
    session.mount(prefix, Bounded())
