"""A real Spark Connect server on loopback, for tests and benchmarks.

Not a test module. Spark's own Connect server
(``org.apache.spark.sql.connect.service.SparkConnectServer``, the plugin
jar pyspark ships) started with ``bin/spark-submit`` on a free port, in a
process group of its own, over ``local[N]``. Its Python workers are this
interpreter (so this install of Beam and beam-pyspark), forked from the
runner's daemon as the RDD engine's are (``spark.python.daemon.module``,
a server-side setting a Connect client cannot make).

``client_environment()`` is the environment of a client process with no
working JVM and only what ``pyspark-client`` gives (tests/connect_client:
no py4j, no SparkContext, no RDD core); ``started_programs()`` asserts
such a process started no JVM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import psutil

from spark_cluster import _terminate_with_parent
from spark_cluster import clean_environment
from spark_cluster import free_port
from spark_cluster import spark_home

SERVER_CLASS = 'org.apache.spark.sql.connect.service.SparkConnectServer'
# The Python of a client with PyPI's pyspark-client (Connect only; the
# version docs/spark-connect.md names) as its pyspark, the project's other
# libraries from its .venv: `make connect-client`.
CLIENT_PYTHON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    '.venv-connect-client', 'bin', 'python')


def client_python() -> str:
  assert os.path.exists(CLIENT_PYTHON), (
      f'{CLIENT_PYTHON} is missing: run `make connect-client` (make test '
      'does)')
  return CLIENT_PYTHON


class ConnectServer:
  """``local[cores]`` behind a Connect endpoint; ``url`` is sc://...;
  ``stop()`` ends it and its Python workers."""
  def __init__(self, directory: str, cores: int = 2, timeout: float = 240,
               conf: dict | None = None, env: dict | None = None,
               wait: bool = True):
    """``wait``: return once it listens (else call ``wait()`` later)."""
    os.makedirs(directory, exist_ok=True)
    self.port = free_port()
    self.url = f'sc://127.0.0.1:{self.port}'
    self.log_path = os.path.join(directory, 'connect-server.log')
    env = clean_environment(env)
    # The server is a driver, not a daemon of a cluster.
    env.pop('SPARK_DAEMON_MEMORY', None)
    settings = {
        'spark.connect.grpc.binding.port': str(self.port),
        'spark.connect.grpc.binding.address': '127.0.0.1',
        'spark.ui.enabled': 'false',
        'spark.python.daemon.module': 'beam_pyspark.spark.daemon',
        'spark.python.worker.reuse': 'true',
        **(conf or {}),
    }
    command = [os.path.join(spark_home(), 'bin', 'spark-submit'),
               '--class', SERVER_CLASS, '--master', f'local[{cores}]',
               '--driver-memory', '1g']
    for key, value in settings.items():
      command += ['--conf', f'{key}={value}']
    command.append('spark-internal')
    self._log = open(self.log_path, 'ab')
    self.proc = subprocess.Popen(
        command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True, preexec_fn=_terminate_with_parent)
    self.timeout = timeout
    if wait:
      self.wait()

  def wait(self) -> None:
    try:
      self._wait(self.timeout)
    except BaseException:
      self.stop()
      raise

  def _wait(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(
            f'the Connect server exited with {self.proc.returncode}:\n'
            f'{self.logs()}')
      try:
        socket.create_connection(('127.0.0.1', self.port), 1).close()
        return
      except OSError:
        time.sleep(0.5)
    raise RuntimeError(
        f'the Connect server did not listen in {timeout}s:\n{self.logs()}')

  def logs(self, limit: int = 8000) -> str:
    with open(self.log_path, 'rb') as f:
      return f.read().decode('utf-8', 'replace')[-limit:]

  def stop(self, grace: float = 15) -> None:
    if self.proc is None:
      return
    try:
      members = [psutil.Process(self.proc.pid)]
      members += members[0].children(recursive=True)
    except psutil.NoSuchProcess:
      members = []
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs(members, timeout=grace)
    for p in alive:
      try:
        p.kill()
      except psutil.NoSuchProcess:
        pass
    try:
      self.proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
      pass
    self._log.close()
    self.proc = None


CLIENT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          'connect_client')
JVM_LAUNCHERS = ('java', 'spark-submit', 'spark-class')


def client_environment(audit: str, extra: dict | None = None) -> dict:
  """A client process's environment: no Java anywhere it could find one
  (JAVA_HOME leads nowhere, no ``java`` on PATH), and the Python of a
  Connect-only install (tests/connect_client: no ``py4j``, no
  ``pyspark.core``, as with ``pyspark-client`` alone), its processes
  written to ``audit`` (``started_programs``)."""
  env = dict(os.environ)
  env['JAVA_HOME'] = '/nonexistent-java'
  env['PATH'] = os.pathsep.join(
      p for p in env.get('PATH', '').split(os.pathsep)
      if p and not os.path.exists(os.path.join(p, 'java')))
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in [CLIENT_DIR, env.get('PYTHONPATH')] if p)
  env['BEAM_PYSPARK_CLIENT_AUDIT'] = audit
  for name in ('SPARK_REMOTE', 'SPARK_CONNECT_MODE_ENABLED',
               'SPARK_SKIP_CONNECT_COMPAT_TESTS', 'SPARK_HOME'):
    env.pop(name, None)
  env.update(extra or {})
  return env


def started_programs(audit: str) -> list[str]:
  """What a client process (``client_environment``) started; asserts it
  started no JVM (nor any of Spark's launch scripts)."""
  if not os.path.exists(audit):
    return []
  with open(audit, encoding='utf-8') as f:
    started = [line.split(' ', 2)[2].strip() for line in f if line.strip()]
  for program in started:
    words = program.split()
    assert not (words and os.path.basename(words[0]) in JVM_LAUNCHERS), (
        f'the Connect-only client started a JVM: {program}')
  return started


_SHARED: list = []


def shared(wait: bool = True) -> ConnectServer:
  """One Connect server for every test of this process that asks for it
  (tests/test_connect.py, tests/test_conformance_connect.py), started on
  first use and stopped when the process exits. ``wait``: return once it
  listens (else call its ``wait()``)."""
  if not _SHARED or _SHARED[0].proc is None:
    import atexit
    import tempfile
    server = ConnectServer(tempfile.mkdtemp(prefix='beam-pyspark-connect-'),
                           wait=False)
    _SHARED[:] = [server]
    atexit.register(server.stop)
  if wait:
    _SHARED[0].wait()
  return _SHARED[0]
