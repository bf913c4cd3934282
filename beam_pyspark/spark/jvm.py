"""A class archive for the driver's JVM: Spark starts about 1 s sooner.

Starting Spark's JVM loads some ten thousand classes from Spark's jars, a
third of a fresh process's fixed cost (benchmarks/fixed_cost.py). Java's
class data sharing (CDS) maps them from an archive instead: measured here,
SparkContext start 3.3 s -> 2.2 s. The archive depends on the JVM and on
Spark's jars, so it is made on this machine, once: the first driver JVM
that finds none writes one when it exits (``-XX:ArchiveClassesAtExit``,
about 2 s more for that one run), under a lock so that only one process at
a time does; later ones map it (``-XX:SharedArchiveFile``). An archive the
JVM cannot use (another JVM, a corrupt file) is ignored by the JVM itself
(``-Xshare:auto``), and its CDS log lines are off. Set
``BEAM_PYSPARK_JVM_CLASS_ARCHIVE=0`` to turn this off.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import time
from typing import Optional

_LOGGER = logging.getLogger(__name__)

ENV_SWITCH = 'BEAM_PYSPARK_JVM_CLASS_ARCHIVE'
# A lock older than this belongs to a process that died before its JVM
# wrote the archive.
STALE_LOCK_SECS = 600
SETTLE_SECS = 30
# The first bytes of a dynamic CDS archive (HotSpot's CDS_DYNAMIC_ARCHIVE_MAGIC).
_DYNAMIC_MAGIC = bytes.fromhex('a8ab0bf0')
_QUIET = '-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off'


def _cache_dir() -> str:
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(
      os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'beam-pyspark', 'jvm')


def _java() -> Optional[str]:
  java_home = os.environ.get('JAVA_HOME')
  if java_home and os.path.exists(os.path.join(java_home, 'bin', 'java')):
    return os.path.realpath(os.path.join(java_home, 'bin', 'java'))
  found = shutil.which('java')
  return os.path.realpath(found) if found else None


def _archive_key(java: str) -> str:
  """What the archive is valid for: this java binary and Spark's jars."""
  import pyspark  # pylint: disable=import-outside-toplevel
  jars = os.path.join(os.path.dirname(pyspark.__file__), 'jars')
  parts = [java, str(os.stat(java).st_mtime_ns), jars, pyspark.__version__]
  return hashlib.sha1('\0'.join(parts).encode()).hexdigest()[:16]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def java_options(cache_dir: Optional[str] = None) -> str:
  """Options for the driver JVM's command line ('' when off or unusable)."""
  if os.environ.get(ENV_SWITCH, '1') in ('0', 'false', 'off'):
    return ''
  try:
    java = _java()
    if java is None:
      return ''
    directory = cache_dir or _cache_dir()
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(directory, f'spark-{_archive_key(java)}')
    archive = prefix + '.jsa'
    _adopt_finished(prefix, archive)
    if os.path.exists(archive):
      return f'-XX:SharedArchiveFile={archive} {_QUIET}'
    if not _take_lock(prefix + '.lock'):
      return ''  # another process is writing it
    # The JVM writes this at exit, after this process may have gone: the
    # next start renames it into place once its writer is gone.
    return (f'-XX:ArchiveClassesAtExit={prefix}.{os.getpid()}.partial '
            f'{_QUIET}')
  except OSError as exn:
    _LOGGER.debug('No JVM class archive: %s', exn)
    return ''


def _take_lock(path: str) -> bool:
  try:
    if time.time() - os.stat(path).st_mtime > STALE_LOCK_SECS:
      os.unlink(path)
  except FileNotFoundError:
    pass
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, 'w') as f:
    f.write(str(os.getpid()))
  return True


def _is_archive(path: str) -> bool:
  with open(path, 'rb') as f:
    return f.read(4) == _DYNAMIC_MAGIC


def _adopt_finished(prefix: str, archive: str) -> None:
  """Moves an archive whose writer has exited into place."""
  for partial in glob.glob(glob.escape(prefix) + '.*.partial'):
    pid_text = partial[len(prefix) + 1:-len('.partial')]
    if not pid_text.isdigit() or _alive(int(pid_text)):
      continue
    # Its JVM may outlive it by the seconds the dump takes.
    if time.time() - os.stat(partial).st_mtime < SETTLE_SECS:
      continue
    if _is_archive(partial) and not os.path.exists(archive):
      os.replace(partial, archive)
    else:
      os.unlink(partial)
    try:
      os.unlink(prefix + '.lock')
    except FileNotFoundError:
      pass
