"""Real storage servers on loopback for the checkpoint-storage tests.

Not a test module. ``MiniHdfs``: Apache Hadoop's MiniDFSCluster (a
NameNode and a DataNode in one JVM, WebHDFS on), from the jars that
``make hdfs-minicluster`` (scripts/hdfs-minicluster.sh) resolves from
Maven Central into ~/.m2, started from tests/hdfs/MiniHdfs.java.
``MotoS3``: moto's standalone S3 server (PyPI ``moto[server]``, the test
extra), which answers S3's conditional PUT (If-None-Match) as S3 does.
Each on 127.0.0.1 with free ports, in a process group of its own that
``stop()`` ends (and that dies with the test process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from spark_cluster import _terminate_with_parent
from spark_cluster import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
HDFS_DIR = os.path.join(HERE, 'hdfs')
HDFS_CLASSPATH = os.path.join(HDFS_DIR, 'target', 'classpath.txt')
ACCESS_KEY, SECRET_KEY, REGION = 'beam-pyspark', 'beam-pyspark-secret', (
    'eu-west-1')


def _stop(proc: subprocess.Popen, grace: float = 20) -> None:
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
    try:
      proc.wait(grace)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait(10)


class MiniHdfs:
  """A MiniDFSCluster: ``url(path)`` is its hdfs:// URL (the NameNode's
  RPC port, Spark's JVM), ``options`` the pipeline options that reach its
  WebHDFS (the NameNode's HTTP port, the runner's Python side)."""
  def __init__(self, directory: str, timeout: float = 180):
    if not os.path.exists(HDFS_CLASSPATH):
      raise RuntimeError(
          f'{HDFS_CLASSPATH} is missing: run `make hdfs-minicluster` '
          '(`make test` does) to resolve Hadoop\'s MiniDFSCluster jars')
    with open(HDFS_CLASSPATH, encoding='utf-8') as f:
      classpath = f.read().strip()
    os.makedirs(directory, exist_ok=True)
    self.log_path = os.path.join(directory, 'minihdfs.log')
    self._log = open(self.log_path, 'wb')
    self.proc = subprocess.Popen(
        ['java', '-Xmx384m', '-XX:+UseSerialGC', '-cp', classpath,
         os.path.join(HDFS_DIR, 'MiniHdfs.java'),
         os.path.join(directory, 'data')],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        preexec_fn=_terminate_with_parent, start_new_session=True)
    line = self._first_line(timeout)
    import json  # pylint: disable=import-outside-toplevel
    ports = json.loads(line)
    self.rpc_port, self.http_port = ports['rpc'], ports['http']
    self.options = ['--hdfs_host=127.0.0.1', f'--hdfs_port={self.http_port}']

  def _first_line(self, timeout: float) -> str:
    found: list = []
    reader = threading.Thread(
        target=lambda: found.append(self.proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not found or not found[0]:
      self.stop()
      raise RuntimeError(f'MiniDFSCluster did not start:\n{self.log()}')
    return found[0].decode('utf-8')

  def url(self, path: str) -> str:
    return f'hdfs://127.0.0.1:{self.rpc_port}/{path.lstrip("/")}'

  def log(self) -> str:
    with open(self.log_path, 'rb') as f:
      return f.read().decode('utf-8', 'replace')[-6000:]

  def stop(self) -> None:
    if self.proc.stdin and not self.proc.stdin.closed:
      try:
        self.proc.stdin.close()  # MiniHdfs shuts down when it closes
      except OSError:
        pass
    _stop(self.proc)
    self._log.close()


class MotoS3:
  """moto's S3 server: ``url(path)`` an s3:// URL in its bucket,
  ``options`` the pipeline options that reach it (Beam's S3 options)."""
  BUCKET = 'checkpoints'

  def __init__(self, directory: str, timeout: float = 60):
    os.makedirs(directory, exist_ok=True)
    self.port = free_port()
    self.endpoint = f'http://127.0.0.1:{self.port}'
    self.log_path = os.path.join(directory, 'moto.log')
    self._log = open(self.log_path, 'wb')
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'moto.server', '-H', '127.0.0.1',
         '-p', str(self.port)],
        stdout=self._log, stderr=subprocess.STDOUT,
        preexec_fn=_terminate_with_parent, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
      try:
        urllib.request.urlopen(f'{self.endpoint}/moto-api/', timeout=2)
        break
      except OSError:
        if self.proc.poll() is not None or time.monotonic() > deadline:
          self.stop()
          raise RuntimeError(f'moto\'s server did not start:\n{self.log()}')
        time.sleep(0.2)
    self.options = [
        f'--s3_endpoint_url={self.endpoint}', f'--s3_region_name={REGION}',
        f'--s3_access_key_id={ACCESS_KEY}',
        f'--s3_secret_access_key={SECRET_KEY}']
    self.filesystem().mkdir(self.BUCKET)

  def filesystem(self):
    import s3fs  # pylint: disable=import-outside-toplevel
    return s3fs.S3FileSystem(
        key=ACCESS_KEY, secret=SECRET_KEY, use_listings_cache=False,
        skip_instance_cache=True,
        client_kwargs={'endpoint_url': self.endpoint, 'region_name': REGION})

  def url(self, path: str) -> str:
    return f's3://{self.BUCKET}/{path.lstrip("/")}'

  def log(self) -> str:
    with open(self.log_path, 'rb') as f:
      return f.read().decode('utf-8', 'replace')[-6000:]

  def stop(self) -> None:
    _stop(self.proc)
    self._log.close()
