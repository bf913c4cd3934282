"""Storage servers on loopback for checkpoints: HDFS and an S3 store.

``MiniHdfs``: Apache Hadoop's MiniDFSCluster (a NameNode and a DataNode in
one JVM, WebHDFS on), from the jars that ``make hdfs-minicluster``
(scripts/minicluster.sh hdfs) resolves from Maven Central into ~/.m2,
started from tests/hdfs/MiniHdfs.java. ``MotoS3``: moto's standalone S3
server (PyPI ``moto[server]``), which answers S3's conditional PUT
(If-None-Match) as S3 does. Each in a process group of its own that
``stop()`` ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

from beam_pyspark.local import processes
from beam_pyspark.local.processes import ServiceError

ACCESS_KEY, SECRET_KEY, REGION = 'beam-pyspark', 'beam-pyspark-secret', (
    'eu-west-1')


class MiniHdfs:
  """A MiniDFSCluster: ``url(path)`` is its hdfs:// URL (the NameNode's
  RPC port, Spark's JVM), ``options`` the pipeline options that reach its
  WebHDFS (the NameNode's HTTP port, the runner's Python side). Ports 0:
  free ones."""

  def __init__(self, directory: str, rpc_port: int = 0, http_port: int = 0,
               timeout: float = 180):
    hdfs_dir = processes.in_clone('tests', 'hdfs')
    jars = processes.read_classpath(
        os.path.join(hdfs_dir, 'target', 'classpath.txt'), 'hdfs-minicluster')
    ports = [str(processes.port_or_free(rpc_port, '--port')) if rpc_port
             else '0',
             str(processes.port_or_free(http_port, '--http-port'))
             if http_port else '0']
    os.makedirs(directory, exist_ok=True)
    self.log_path = os.path.join(directory, 'minihdfs.log')
    self.process = processes.start(
        [processes.java(), '-Xmx384m', '-XX:+UseSerialGC', '-cp', jars,
         os.path.join(hdfs_dir, 'MiniHdfs.java'),
         os.path.join(directory, 'data'), *ports],
        self.log_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
      found = json.loads(self._first_line(timeout))
    except BaseException:
      self.stop()
      raise
    self.rpc_port, self.http_port = found['rpc'], found['http']
    self.options = ['--hdfs_host=127.0.0.1', f'--hdfs_port={self.http_port}']

  def _first_line(self, timeout: float) -> str:
    found: list = []
    reader = threading.Thread(
        target=lambda: found.append(self.process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not found or not found[0]:
      raise ServiceError(f'MiniDFSCluster did not start; the end of its log '
                         f'({self.log_path}):\n{self.log()}')
    return found[0].decode('utf-8')

  def url(self, path: str) -> str:
    return f'hdfs://127.0.0.1:{self.rpc_port}/{path.lstrip("/")}'

  def log(self) -> str:
    return processes.log_tail(self.log_path)

  def stop(self) -> None:
    if self.process.stdin and not self.process.stdin.closed:
      try:
        self.process.stdin.close()  # MiniHdfs shuts down when it closes
      except OSError:
        pass
    processes.stop(self.process)


class MotoS3:
  """moto's S3 server: ``url(path)`` an s3:// URL in its bucket,
  ``options`` the pipeline options that reach it (Beam's S3 options)."""
  BUCKET = 'checkpoints'

  def __init__(self, directory: str, port: int = 0, timeout: float = 60):
    for module, package in (('moto', 'moto[server]'), ('flask', 'moto[server]'),
                            ('s3fs', 's3fs')):
      if importlib.util.find_spec(module) is None:
        raise ServiceError(
            f'{module} is not installed in this Python ({sys.executable}): '
            f'pip install \'{package}\' (in a clone, `make s3` installs '
            'the test extra, which has it)')
    os.makedirs(directory, exist_ok=True)
    self.port = processes.port_or_free(port, '--port')
    self.endpoint = f'http://127.0.0.1:{self.port}'
    self.log_path = os.path.join(directory, 'moto.log')
    self.process = processes.start(
        [sys.executable, '-m', 'moto.server', '-H', '127.0.0.1',
         '-p', str(self.port)], self.log_path)
    try:
      self._wait(timeout)
    except BaseException:
      self.stop()
      raise
    self.options = [
        f'--s3_endpoint_url={self.endpoint}', f'--s3_region_name={REGION}',
        f'--s3_access_key_id={ACCESS_KEY}',
        f'--s3_secret_access_key={SECRET_KEY}']
    self.filesystem().mkdir(self.BUCKET)

  def _wait(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
      try:
        urllib.request.urlopen(f'{self.endpoint}/moto-api/', timeout=2)
        return
      except OSError as exn:
        if self.process.poll() is not None or time.monotonic() > deadline:
          raise ServiceError(
              f'moto\'s server did not start ({exn}); the end of its log '
              f'({self.log_path}):\n{self.log()}') from exn
        time.sleep(0.2)

  def filesystem(self):
    import s3fs  # pylint: disable=import-outside-toplevel
    return s3fs.S3FileSystem(
        key=ACCESS_KEY, secret=SECRET_KEY, use_listings_cache=False,
        skip_instance_cache=True,
        client_kwargs={'endpoint_url': self.endpoint, 'region_name': REGION})

  def url(self, path: str) -> str:
    return f's3://{self.BUCKET}/{path.lstrip("/")}'

  def log(self) -> str:
    return processes.log_tail(self.log_path)

  def stop(self) -> None:
    processes.stop(self.process)
