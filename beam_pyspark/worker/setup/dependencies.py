"""A job's staged Python dependencies, installed and imported in executors.

What Beam's container boot does for a Docker SDK harness (boot.go), done
inside a Spark Python worker for the embedded harness:

* the staged files are written once per host into a directory named by their
  content (two jobs with the same dependencies share it), under a file lock,
  so that concurrent Python workers and executors on one host install once;
* ``requirements.txt`` (and other pip requirements files) are installed with
  ``--no-index --find-links <staged files>``, as Beam does: the requirements
  cache that the client staged is all they may use; the packages listed in
  ``extra_packages.txt`` and ``workflow.tar.gz`` (``--setup_file``) are
  installed next, from the staged files first;
* they go into a virtual environment of the job's own, created without pip
  over the executor's Python. pip (the executor's own) runs with the
  executor's ``sys.path`` visible, so requirements the executor already
  satisfies (Beam itself, say) are left alone rather than installed again,
  and a different version of an installed package goes into the job's
  directory, never over the executor's (pip does not uninstall outside the
  environment it installs into). ``pip install --target`` would ignore what
  is installed and reinstall every dependency, which fails offline for any
  package that depends on ``apache-beam``;
* the job's directory goes first on ``sys.path`` for that job's tasks only:
  a Python worker reused by another job drops it, and forgets (purges from
  ``sys.modules``) every module it loaded from it, so two jobs with
  different versions of one package both import their own;
* a pickled main session (``--save_main_session``) is loaded whenever the
  worker switches to the job, as Beam's ``sdk_worker_main`` loads it before
  the harness starts.

Nothing here knows Spark: the staged files arrive through ``fetch``
(``artifacts.ArtifactSource.fetcher``: streamed from the driver to disk),
which writes one file and checks its size and digest as it comes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable
from typing import Iterable
from typing import Mapping
from typing import Optional

from beam_pyspark.errors import PipelineExecutionError

_LOGGER = logging.getLogger(__name__)

# Staged names with a meaning, as Beam's stager writes them
# (apache_beam.runners.portability.stager, runners.internal.names).
REQUIREMENTS_FILE = 'requirements.txt'
EXTRA_PACKAGES_FILE = 'extra_packages.txt'
WORKFLOW_TARBALL_FILE = 'workflow.tar.gz'
PICKLED_MAIN_SESSION_FILE = 'pickled_main_session'
SUBMISSION_ENV_DEPENDENCIES_FILE = 'submission_environment_dependencies.txt'
STAGED_SDK_SOURCES_FILE = 'dataflow_python_sdk.tar'

# Where installs go: $BEAM_PYSPARK_DEPS_DIR (e.g. through
# spark.executorEnv.BEAM_PYSPARK_DEPS_DIR), else the temporary directory.
DEPS_DIR_ENV = 'BEAM_PYSPARK_DEPS_DIR'

_COMPLETE = '.complete'
_FORMAT = 1  # bump when the layout of an install directory changes


def skip_reason(name: str) -> Optional[str]:
  """Why a staged file is not shipped to executors, or None if it is."""
  if name == SUBMISSION_ENV_DEPENDENCIES_FILE:
    return 'only logged by Beam\'s container'
  if name == STAGED_SDK_SOURCES_FILE or (
      name.startswith('apache_beam-') and name.endswith('.whl')):
    return 'executors run the Beam SDK installed with them'
  if name.endswith('.jar'):
    return 'a jar for a Java SDK harness'
  return None


@dataclasses.dataclass(frozen=True)
class StagedFile:
  name: str  # the staged name, a plain file name
  sha256: str
  size: int
  requirements: bool = False  # a pip requirements file


@dataclasses.dataclass(frozen=True)
class DependencySet:
  """A job's staged files, named by their content."""
  files: tuple[StagedFile, ...]

  @property
  def key(self) -> str:
    h = hashlib.sha256(f'beam-pyspark-deps:{_FORMAT}'.encode())
    for f in sorted(self.files, key=lambda f: f.name):
      h.update(f'\0{f.name}\0{f.sha256}\0{int(f.requirements)}'.encode())
    return h.hexdigest()

  @property
  def total_bytes(self) -> int:
    return sum(f.size for f in self.files)

  def names(self) -> list[str]:
    return [f.name for f in self.files]


def dependency_set(
    contents: Mapping[str, bytes],
    requirements: Iterable[str] = ()) -> DependencySet:
  """The set describing these files (name -> content).

  Raises PipelineExecutionError for a name that is not a plain file name:
  names come from the client and become paths on every executor.
  """
  reqs = set(requirements)
  return files_set([
      StagedFile(name, hashlib.sha256(data).hexdigest(), len(data),
                 name in reqs)
      for name, data in contents.items()])


def files_set(files: Iterable[StagedFile]) -> DependencySet:
  """The set of these files (requirements.txt is always a requirements
  file); raises PipelineExecutionError for a name that is not a plain
  file name."""
  checked = []
  for f in sorted(files, key=lambda f: f.name):
    check_name(f.name)
    checked.append(dataclasses.replace(
        f, requirements=f.requirements or f.name == REQUIREMENTS_FILE))
  return DependencySet(tuple(checked))


# fetch(file, path): writes the staged file's bytes to path, checked
# (write_verified), or raises PipelineExecutionError.
Fetch = Callable[[StagedFile, str], None]


def write_verified(chunks: Iterable[bytes], dest: str, f: StagedFile) -> None:
  """Writes ``chunks`` to ``dest`` through a temporary name; raises
  PipelineExecutionError unless they are ``f``'s size and digest."""
  tmp = f'{dest}.part-{os.getpid()}-{threading.get_ident()}'
  hasher, received = hashlib.sha256(), 0
  try:
    with open(tmp, 'wb') as out:
      for chunk in chunks:
        hasher.update(chunk)
        received += len(chunk)
        if received > f.size:
          break
        out.write(chunk)
    if received != f.size or hasher.hexdigest() != f.sha256:
      raise PipelineExecutionError(
          f'Staged dependency {f.name!r} did not reach this executor intact '
          f'(expected {f.size} bytes with sha256 {f.sha256}).')
    os.replace(tmp, dest)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def fetch_from(contents: Mapping[str, bytes]) -> Fetch:
  """A fetch over files held in memory (tests; small embedded data)."""
  def fetch(f: StagedFile, dest: str) -> None:
    data = contents.get(f.name)
    write_verified([] if data is None else [data], dest, f)
  return fetch


def check_name(name: str) -> None:
  if (not name or name in ('.', '..') or '/' in name or '\\' in name or
      '\0' in name or name != os.path.basename(name)):
    raise PipelineExecutionError(
        f'Staged dependency name {name!r} is not a plain file name; stage '
        'files under plain names (Beam\'s stager does).')


def default_root() -> str:
  root = os.environ.get(DEPS_DIR_ENV)
  if root:
    return root
  uid = os.getuid() if hasattr(os, 'getuid') else 'user'
  return os.path.join(tempfile.gettempdir(), f'beam-pyspark-deps-{uid}')


def _interpreter_tag() -> str:
  """Installs are per interpreter: a venv is tied to the Python making it."""
  text = f'{sys.executable}\0{sys.version}'
  return hashlib.sha256(text.encode()).hexdigest()[:8]


# -- installing -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Installed:
  """An install directory, complete: what goes on sys.path."""
  directory: str
  staged_dir: str
  site_dir: Optional[str]  # None: nothing to pip install
  main_session: Optional[str]


def install(
    deps: DependencySet,
    fetch: Fetch,
    root: Optional[str] = None,
    pip_timeout: Optional[float] = None) -> Installed:
  """Installs the set once per host (and interpreter); returns where it is.

  Concurrent callers, in threads or processes, wait for the one installing.
  A failed install leaves nothing behind that a retry would trust.
  """
  root = os.path.abspath(root or default_root())
  os.makedirs(root, exist_ok=True)
  directory = os.path.join(root, f'{deps.key[:32]}-{_interpreter_tag()}')
  with _host_lock(directory + '.lock'):
    installed = _read_complete(directory, deps)
    if installed is not None:
      return installed
    # No mark of completion: nothing here can be trusted (an install that
    # died half way, in a process that was killed).
    shutil.rmtree(directory, ignore_errors=True)
    started = time.monotonic()
    try:
      _write_staged(os.path.join(directory, 'staged'), deps, fetch)
      has_site = _pip_install(directory, deps, root, pip_timeout)
      with open(os.path.join(directory, _COMPLETE), 'w') as f:
        json.dump({'key': deps.key, 'names': deps.names(), 'site': has_site},
                  f)
    except BaseException:
      shutil.rmtree(directory, ignore_errors=True)
      raise
    _LOGGER.info(
        'Installed %d staged dependencies (%d bytes) in %s in %.1fs',
        len(deps.files), deps.total_bytes, directory,
        time.monotonic() - started)
    installed = _read_complete(directory, deps)
    assert installed is not None
    return installed


def _read_complete(directory: str, deps: DependencySet) -> Optional[Installed]:
  try:
    with open(os.path.join(directory, _COMPLETE)) as f:
      done = json.load(f)
  except (OSError, ValueError):
    return None
  if done.get('key') != deps.key:
    return None
  staged = os.path.join(directory, 'staged')
  session = os.path.join(staged, PICKLED_MAIN_SESSION_FILE)
  return Installed(
      directory=directory,
      staged_dir=staged,
      site_dir=_site_dir(os.path.join(directory, 'venv'))
      if done.get('site') else None,
      main_session=session if PICKLED_MAIN_SESSION_FILE in deps.names()
      else None)


def _write_staged(staged: str, deps: DependencySet, fetch: Fetch) -> None:
  os.makedirs(staged, exist_ok=True)
  for f in deps.files:
    check_name(f.name)
    fetch(f, os.path.join(staged, f.name))


def _packages(staged: str, deps: DependencySet) -> list[str]:
  """What to pip install besides requirements, in Beam's order."""
  names = set(deps.names())
  packages = []
  if EXTRA_PACKAGES_FILE in names:
    with open(os.path.join(staged, EXTRA_PACKAGES_FILE)) as f:
      for line in f:
        name = line.strip()
        if not name:
          continue
        check_name(name)
        if name not in names:
          raise PipelineExecutionError(
              f'{EXTRA_PACKAGES_FILE} lists {name!r}, which was not staged '
              f'(staged: {sorted(names)}).')
        packages.append(name)
  if WORKFLOW_TARBALL_FILE in names:
    packages.append(WORKFLOW_TARBALL_FILE)
  return packages


def _pip_install(
    directory: str, deps: DependencySet, root: str,
    timeout: Optional[float]) -> bool:
  """pip installs the staged packages into the job's venv; False if none."""
  staged = os.path.join(directory, 'staged')
  requirements = [f.name for f in deps.files if f.requirements]
  packages = _packages(staged, deps)
  if not requirements and not packages:
    return False
  venv_dir = os.path.join(directory, 'venv')
  import venv
  venv.EnvBuilder(
      with_pip=False, symlinks=os.name != 'nt', clear=True).create(venv_dir)
  python = os.path.join(
      venv_dir, 'Scripts' if os.name == 'nt' else 'bin',
      'python.exe' if os.name == 'nt' else 'python')
  # --no-build-isolation: sdists (workflow.tar.gz among them) build with the
  # executor's setuptools; isolation would fetch one from an index.
  pip = [
      python, '-m', 'pip', 'install', '--disable-pip-version-check',
      '--no-cache-dir', '--no-build-isolation', '--find-links', staged
  ]
  for name in requirements:
    # As Beam's boot does: requirements come from the staged cache only.
    _run_pip(
        pip + ['--no-index', '-r', os.path.join(staged, name)], root, timeout)
  if packages:
    _run_pip(pip + [os.path.join(staged, p) for p in packages], root, timeout)
  return True


def _run_pip(
    command: list[str], root: str, timeout: Optional[float]) -> None:
  env = dict(os.environ)
  # The executor's own packages are visible to pip (and to the builds it
  # runs), so what they satisfy is not installed again.
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in sys.path
      if p and os.path.exists(p) and not _under(os.path.abspath(p), root))
  env['PIP_DISABLE_PIP_VERSION_CHECK'] = '1'
  env.pop('PYTHONHOME', None)
  started = time.monotonic()
  try:
    done = subprocess.run(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired as exn:
    raise PipelineExecutionError(
        f'Installing staged dependencies timed out after {timeout}s: '
        f'{" ".join(command[1:])}') from exn
  if done.returncode != 0:
    raise PipelineExecutionError(
        'Installing the staged dependencies failed on this executor '
        f'({os.uname().nodename if hasattr(os, "uname") else "host"}): '
        f'`{" ".join(command[1:])}` exited with {done.returncode}:\n'
        f'{done.stdout[-4000:]}')
  _LOGGER.info(
      'pip ran in %.1fs: %s', time.monotonic() - started, ' '.join(command[3:]))


def _site_dir(venv_dir: str) -> str:
  import sysconfig
  return sysconfig.get_path(
      'purelib', vars={'base': venv_dir, 'platbase': venv_dir})


_thread_locks_lock = threading.Lock()
_thread_locks: dict[str, threading.Lock] = {}


@contextlib.contextmanager
def _host_lock(path: str):
  """Held by one thread of one process on this host at a time."""
  with _thread_locks_lock:
    lock = _thread_locks.setdefault(path, threading.Lock())
  with lock:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
      try:
        import fcntl
      except ImportError:  # not POSIX: threads of this process only
        fcntl = None
      if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
      yield
    finally:
      os.close(fd)  # releases the flock


def _under(path: str, directory: str) -> bool:
  return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


# -- activating in this process ---------------------------------------------


@dataclasses.dataclass
class _Active:
  key: str
  directory: str
  paths: list[str]  # what activation added to sys.path


_active_lock = threading.RLock()
_active: Optional[_Active] = None


def active_key() -> Optional[str]:
  """The dependency set this process imports from now, if any."""
  with _active_lock:
    return _active.key if _active is not None else None


def activate(
    deps: Optional[DependencySet],
    fetch: Optional[Fetch] = None,
    root: Optional[str] = None) -> None:
  """Makes deps (None: no staged dependencies) what this process imports.

  Called by every task before it touches the job's code; costs a comparison
  when the process already serves the same dependencies.
  """
  global _active
  key = deps.key if deps is not None and deps.files else None
  with _active_lock:
    if (_active.key if _active is not None else None) == key:
      return
    installed = install(deps, fetch, root) if key is not None else None
    _deactivate()
    if installed is None:
      return
    import importlib
    import site
    before = list(sys.path)
    if installed.site_dir is not None:
      sys.path.insert(0, installed.site_dir)
      # .pth files of what pip installed (namespace packages, say).
      site.addsitedir(installed.site_dir)
    # Beam's sdk_worker_main puts the staged directory on sys.path too
    # (files staged with --files_to_stage are importable there).
    sys.path.append(installed.staged_dir)
    importlib.invalidate_caches()
    _active = _Active(
        key, installed.directory, [p for p in sys.path if p not in before])
    if installed.main_session is not None:
      _load_main_session(installed.main_session)


def _deactivate() -> None:
  global _active
  if _active is None:
    return
  import importlib
  active, _active = _active, None
  for path in active.paths:
    while path in sys.path:
      sys.path.remove(path)
    sys.path_importer_cache.pop(path, None)
  purge_modules(active.directory)
  importlib.invalidate_caches()


def purge_modules(directory: str) -> list[str]:
  """Forgets the modules loaded from under directory; returns their names.

  Objects already built from them (a cached harness's DoFns) keep working;
  the next import finds whatever sys.path offers then.
  """
  directory = os.path.abspath(directory)
  purged = []
  for name, module in list(sys.modules.items()):
    origins = [getattr(module, '__file__', None)]
    try:
      origins.extend(getattr(module, '__path__', None) or ())
    except TypeError:
      pass
    if any(isinstance(o, str) and _under(os.path.abspath(o), directory)
           for o in origins):
      del sys.modules[name]
      purged.append(name)
  return purged


def _load_main_session(path: str) -> None:
  # As Beam's sdk_worker_main: a session that does not load is logged, not
  # fatal (with cloudpickle it holds only registries of custom coders and
  # types).
  from apache_beam.internal import pickler
  if os.path.getsize(path) == 0:
    _LOGGER.warning('The pickled main session %s is empty', path)
    return
  try:
    pickler.load_session(path)
  except Exception:  # pylint: disable=broad-except
    _LOGGER.warning('Could not load the pickled main session %s', path,
                    exc_info=True)
