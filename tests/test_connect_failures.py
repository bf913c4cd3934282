"""A Spark Connect server lost mid-job fails the job, promptly.

PySpark's Connect client retries an unreachable server (gRPC
UNAVAILABLE) for minutes with backoff, and a reattachable execution for
up to an hour: a client whose server was killed sat silent for 5
minutes and more. A job over Connect must instead fail within seconds of
its server's death, naming the endpoint.
"""
import os
import signal
import subprocess
import sys
import time

import connect_server
from connect_server import client_environment

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_killed_connect_server_fails_the_job_naming_its_endpoint(tmp_path):
  # A server of its own: this one is killed.
  server = connect_server.ConnectServer(str(tmp_path / 'server'))
  marker = str(tmp_path / 'started.txt')
  log_path = str(tmp_path / 'client.log')
  client = None
  try:
    with open(log_path, 'wb') as log:
      client = subprocess.Popen(
          [sys.executable, os.path.join(HERE, 'connect_sleeper.py'),
           server.url, marker],
          cwd=HERE, env=client_environment(str(tmp_path / 'audit.txt')),
          stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not os.path.exists(marker):
      assert client.poll() is None, _read(log_path)
      assert time.monotonic() < deadline, _read(log_path)
      time.sleep(0.5)
    # kill -9 of the whole server: its JVM and its Python workers.
    os.killpg(server.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
      code = client.wait(timeout=120)
    except subprocess.TimeoutExpired:
      code = None
    waited = time.monotonic() - killed
    log = _read(log_path)
    assert code is not None and waited < 60, (
        f'the client still ran {waited:.0f}s after its server was killed:\n'
        f'{log[-4000:]}')
    assert code != 0, log[-4000:]
    # The job's error says the server is gone, and which one.
    assert f'Lost the Spark Connect server at {server.url}' in log, log[-4000:]
  finally:
    if client is not None and client.poll() is None:
      client.kill()
    server.stop()


def _read(path: str) -> str:
  with open(path, encoding='utf-8', errors='replace') as f:
    return f.read()
