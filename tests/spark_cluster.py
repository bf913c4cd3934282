"""A real Spark standalone cluster on loopback, for tests.

Not a test module. A master and workers from the Spark distribution that
pyspark ships (its pip package has no sbin/ scripts, so they are started
with ``bin/spark-class``), each in a process group of its own so that
stopping the cluster also ends the executors the workers launched.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil

# Free loopback ports; SIGTERM to a child when the test process dies, so
# that a killed test leaves no cluster behind (spark-class execs the JVM,
# which keeps it, and a worker's shutdown ends its executors).
from beam_pyspark.local.processes import free_port  # noqa: F401 (re-exported)
from beam_pyspark.local.processes import (
    terminate_with_parent as _terminate_with_parent)


def spark_home() -> str:
  from pyspark.find_spark_home import _find_spark_home
  return _find_spark_home()


def clean_environment(extra: dict | None = None) -> dict:
  """The environment of the cluster's processes (and so of executors).

  No pip configuration of this machine leaks in: executors install staged
  dependencies from the staged files only (PIP_NO_INDEX), as a cluster
  without network access would.
  """
  env = {k: v for k, v in os.environ.items() if not k.startswith('PIP_')}
  env.update(
      PIP_CONFIG_FILE=os.devnull,
      PIP_NO_INDEX='1',
      SPARK_HOME=spark_home(),
      SPARK_LOCAL_IP='127.0.0.1',
      # The daemons themselves stay small: they only schedule.
      SPARK_DAEMON_MEMORY='256m',
      PYSPARK_PYTHON=sys.executable,
      PYSPARK_DRIVER_PYTHON=sys.executable)
  env.pop('PYTHONPATH', None)
  env.update(extra or {})
  return env


class StandaloneCluster:
  """A master and ``workers`` workers on 127.0.0.1; ``stop()`` ends all."""
  def __init__(
      self, directory: str, workers: int = 2, cores: int = 2,
      memory: str = '2g', env: dict | None = None, timeout: float = 180):
    self.directory = directory
    os.makedirs(directory, exist_ok=True)
    self.env = clean_environment(env)
    self.port = free_port()
    self.ui_port = free_port()
    self.url = f'spark://127.0.0.1:{self.port}'
    self.procs: list[subprocess.Popen] = []
    self._logs: list = []
    spark_class = os.path.join(spark_home(), 'bin', 'spark-class')
    try:
      self._start(
          'master',
          [spark_class, 'org.apache.spark.deploy.master.Master',
           '--host', '127.0.0.1', '--port', str(self.port),
           '--webui-port', str(self.ui_port)],
          # No REST submission server: its fixed port (6066) would clash
          # with other clusters on the machine.
          {'SPARK_MASTER_OPTS': '-Dspark.master.rest.enabled=false'})
      for i in range(workers):
        work_dir = os.path.join(directory, f'worker-{i}')
        os.makedirs(work_dir, exist_ok=True)
        self._start(
            f'worker-{i}',
            [spark_class, 'org.apache.spark.deploy.worker.Worker',
             '--host', '127.0.0.1', '--port', '0', '--webui-port', '0',
             '--cores', str(cores), '--memory', memory,
             '--work-dir', work_dir, self.url], {})
      deadline = time.monotonic() + timeout
      while time.monotonic() < deadline:
        state = self.state()
        if state and state.get('aliveworkers', 0) >= workers:
          return
        for proc in self.procs:
          if proc.poll() is not None:
            raise RuntimeError(
                f'{proc.args[1]} exited with {proc.returncode}:\n'
                f'{self.logs()}')
        time.sleep(1)
      raise RuntimeError(
          f'{workers} workers did not register in {timeout}s:\n{self.logs()}')
    except BaseException:
      self.stop()
      raise

  def _start(self, name: str, command: list[str], env: dict) -> None:
    log = open(os.path.join(self.directory, f'{name}.log'), 'ab')
    self._logs.append(log)
    self.procs.append(
        subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT,
            env={**self.env, **env}, start_new_session=True,
            preexec_fn=_terminate_with_parent))

  def state(self) -> dict | None:
    """The master's view (its web UI's JSON), None while it is starting."""
    try:
      with urllib.request.urlopen(
          f'http://127.0.0.1:{self.ui_port}/json/', timeout=5) as r:
        return json.load(r)
    except (OSError, ValueError):
      return None

  def executors(self) -> list[psutil.Process]:
    """The executor JVMs that the workers launched."""
    found = []
    for proc in self.procs[1:]:
      try:
        children = psutil.Process(proc.pid).children(recursive=True)
      except psutil.NoSuchProcess:
        continue
      for child in children:
        try:
          if 'CoarseGrainedExecutorBackend' in ' '.join(child.cmdline()):
            found.append(child)
        except psutil.NoSuchProcess:
          pass
    return found

  def logs(self, limit: int = 6000) -> str:
    """The daemons' and executors' logs, the end of each."""
    parts = []
    paths = sorted(glob.glob(os.path.join(self.directory, '*.log')))
    paths += sorted(
        glob.glob(os.path.join(self.directory, 'worker-*', '*', '*', 'stderr')))
    for path in paths:
      with open(path, 'rb') as f:
        text = f.read().decode('utf-8', 'replace')
      parts.append(f'== {path}\n{text[-limit:]}')
    return '\n'.join(parts)

  def stop(self, grace: float = 15) -> None:
    """Ends the daemons and everything they started, even if they hang."""
    members = []
    for proc in self.procs:
      try:
        root = psutil.Process(proc.pid)
        members.append(root)
        members.extend(root.children(recursive=True))
      except psutil.NoSuchProcess:
        pass
    for proc in reversed(self.procs):  # workers first, then the master
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass
    _, alive = psutil.wait_procs(members, timeout=grace)
    for p in alive:
      try:
        p.kill()
      except psutil.NoSuchProcess:
        pass
    psutil.wait_procs(alive, timeout=grace)
    for proc in self.procs:
      try:
        proc.wait(timeout=grace)
      except subprocess.TimeoutExpired:
        pass
    for log in self._logs:
      log.close()
    self.procs = []
    self._logs = []
