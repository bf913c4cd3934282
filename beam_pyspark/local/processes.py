"""What every local service shares: the clone's files, Java, ports, and
processes that start, get waited for and stop as a group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from beam_pyspark.javahome import find_java

# A clone's root: beam_pyspark/local/processes.py -> the repository.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


class ServiceError(RuntimeError):
  """A local service could not start; the message says what to do."""


def in_clone(*parts: str) -> str:
  """A file of the repository's clone (``sdks/...``, ``tests/hdfs/...``),
  or ServiceError when beam-pyspark was installed without one."""
  if not os.path.exists(os.path.join(ROOT, 'Makefile')) or not os.path.isdir(
      os.path.join(ROOT, 'sdks', 'xlang')):
    raise ServiceError(
        f'beam-pyspark local starts its Java services from a clone of '
        f'beam-pyspark\'s repository, for trying its docs; this installation '
        f'({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}) is '
        'not one: clone the repository, `pip install -e .` there and run the '
        'command from it')
  return os.path.join(ROOT, *parts)


def read_classpath(path: str, make_target: str) -> str:
  """A classpath Maven resolved (``make <make_target>`` writes it)."""
  if not os.path.exists(path):
    raise ServiceError(
        f'{path} is missing: run `make {make_target}` in {ROOT} (Maven '
        'resolves the jars into ~/.m2)')
  with open(path, encoding='utf-8') as f:
    return f.read().strip()


def java() -> str:
  found = find_java()
  if not found:
    raise ServiceError('no java on PATH (and JAVA_HOME names none): install '
                       'Java 17 or later (`make setup` does)')
  return found


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def port_or_free(port: int, flag: str) -> int:
  """``port``, checked to be free (0: a free one), so that a port in use
  is named at once rather than in a JVM's log."""
  if port == 0:
    return free_port()
  with socket.socket() as s:
    try:
      s.bind(('127.0.0.1', port))
    except OSError as exn:
      raise ServiceError(f'port {port} is in use ({exn.strerror}): pass '
                         f'{flag} with another port, or {flag} 0 for a free '
                         'one') from exn
  return port


def terminate_with_parent() -> None:
  """In the child: SIGTERM when the starting process dies, however it dies
  (Linux), so that a killed test or command leaves no server behind."""
  if sys.platform.startswith('linux'):
    import ctypes  # pylint: disable=import-outside-toplevel
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(command: list[str], log_path: str, **kwargs) -> subprocess.Popen:
  """``command`` in a process group of its own (a terminal's Ctrl-C reaches
  the command, which stops it), its output to ``log_path``."""
  # Linux's parent-death signal follows the thread that started the child:
  # one started from a short-lived thread would be ended with that thread.
  main = threading.current_thread() is threading.main_thread()
  with open(log_path, 'ab') as log:
    kwargs.setdefault('stdout', log)
    return subprocess.Popen(
        command, stderr=log, start_new_session=True,
        preexec_fn=terminate_with_parent if main else None, **kwargs)


def stop(proc: subprocess.Popen | None, grace: float = 20) -> None:
  """SIGTERM to ``proc``'s group, SIGKILL after ``grace`` s."""
  if proc is None or proc.poll() is not None:
    return
  try:
    os.killpg(proc.pid, signal.SIGTERM)
  except ProcessLookupError:
    pass
  try:
    proc.wait(grace)
  except subprocess.TimeoutExpired:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait(10)


def log_tail(path: str, chars: int = 6000) -> str:
  try:
    with open(path, 'rb') as f:
      return f.read().decode('utf-8', 'replace')[-chars:]
  except OSError:
    return ''


class JavaServer:
  """A server in a JVM of its own (``process``), logging to ``log_path``."""
  process: subprocess.Popen | None = None
  log_path: str = ''

  def log_tail(self, chars: int = 6000) -> str:
    return log_tail(self.log_path, chars)

  def stop(self) -> None:
    stop(self.process, grace=30)



def wait_listening(proc: subprocess.Popen, port: int, timeout: float,
                   what: str, log_path: str, every: float = 0.3) -> None:
  """Until ``proc`` listens on ``port``; ServiceError with its log's end
  if it exits first or does not listen within ``timeout`` s."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise ServiceError(f'{what} exited with {proc.returncode}; the end of '
                         f'its log ({log_path}):\n{log_tail(log_path)}')
    try:
      with socket.create_connection(('127.0.0.1', port), timeout=1):
        return
    except OSError:
      time.sleep(every)
  raise ServiceError(f'{what} did not listen on port {port} within '
                     f'{timeout:g} s; the end of its log ({log_path}):\n'
                     f'{log_tail(log_path)}')
