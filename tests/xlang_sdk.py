"""Java for multi-language tests: the classpaths `make sdk-xlang` resolved
and Beam's Java expansion services started from them.

Not a test module: tests/test_xlang_*.py share it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from java_sdk import java  # noqa: F401  (kafka_broker's, too)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XLANG_DIR = os.path.join(ROOT, 'sdks', 'xlang')
SQL_CLASSPATH_FILE = os.path.join(XLANG_DIR, 'sql', 'target', 'classpath.txt')
KAFKA_CLASSPATH_FILE = os.path.join(
    XLANG_DIR, 'kafka', 'target', 'classpath.txt')
BROKER_CLASSPATH_FILE = os.path.join(
    XLANG_DIR, 'broker', 'target', 'classpath.txt')
EXPANSION_SCRIPT = os.path.join(ROOT, 'scripts', 'expansion-service.sh')


def read_classpath(path: str) -> str:
  """A resolved classpath, or the test fails saying how to get it (a
  missing toolchain is a broken setup, never a reason to skip)."""
  if not os.path.exists(path):
    pytest.fail(f'{path} is missing: run `make sdk-xlang` (make test does) '
                'to resolve the Java parts with Maven.')
  with open(path, encoding='utf-8') as f:
    return f.read().strip()


def stop_process(process) -> None:
  """Terminates ``process`` (30 s, then kills it)."""
  if process.poll() is None:
    process.terminate()
    try:
      process.wait(timeout=30)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


def wait_listening(process, port: int, timeout: float, what: str,
                   log_tail, stop, every: float = 0.5) -> None:
  """Until ``process`` listens on ``port``; fails the test (after
  ``stop()``) if it exits or does not listen in ``timeout`` s."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if process.poll() is not None:
      stop()
      pytest.fail(f'{what} exited with {process.returncode}:\n{log_tail()}')
    try:
      with socket.create_connection(('127.0.0.1', port), timeout=1):
        return
    except OSError:
      time.sleep(every)
  stop()
  pytest.fail(f'{what} did not listen in {timeout} s:\n{log_tail()}')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class ExpansionService:
  """Beam's Java expansion service (``sql`` or ``kafka``) on a free port,
  started by scripts/expansion-service.sh as a user starts it."""

  def __init__(self, name: str, log_dir: str, *args: str,
               timeout: float = 300):
    read_classpath(os.path.join(XLANG_DIR, name, 'target', 'classpath.txt'))
    self.port = _free_port()
    self.address = f'localhost:{self.port}'
    self.log_path = os.path.join(log_dir, f'expansion-{name}.log')
    self._log = open(self.log_path, 'wb')
    self.process = subprocess.Popen(
        [EXPANSION_SCRIPT, name, str(self.port), *args],
        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
    # It lists its transforms before it listens: on a busy 2-core machine
    # that took 30 s.
    wait_listening(self.process, self.port, timeout,
                   f'the {name} expansion service', self.log_tail, self.stop)

  def log_tail(self, chars: int = 6000) -> str:
    with open(self.log_path, 'rb') as f:
      return f.read().decode('utf-8', 'replace')[-chars:]

  def stop(self) -> None:
    stop_process(self.process)
    self._log.close()
