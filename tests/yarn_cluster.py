"""Apache Hadoop's MiniYARNCluster (a ResourceManager and one NodeManager)
with a MiniDFSCluster beside it, for tests/test_yarn.py (issue 42).

Not a test module. tests/yarn/MiniYarn.java in a JVM of its own, from the
classpath `make yarn-minicluster` resolves; it writes a HADOOP_CONF_DIR with
the clusters' real addresses, which Spark's YARN client reads. Containers
run on this machine as the NodeManager's children: executors start this
virtualenv's Python (PYSPARK_PYTHON), as they would where every node has the
same environment installed (docs/guide/clusters.md, YARN).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request

import pyspark

from beam_pyspark.local import processes

HERE = os.path.dirname(os.path.abspath(__file__))
YARN_DIR = os.path.join(HERE, 'yarn')
CLASSPATH = os.path.join(YARN_DIR, 'target', 'classpath.txt')
PYSPARK_JARS = os.path.join(os.path.dirname(pyspark.__file__), 'jars')

# What a job on this one small NodeManager (4 GiB) asks for: one executor
# of 2 cores, small containers. spark.yarn.jars names pyspark's own jars
# as present on every node (local:), so that the client uploads none of
# its 280 jars to HDFS for each application; pyspark's jars include
# spark-yarn_2.13 of its own version.
SPARK_CONF = (
    f'spark.yarn.jars=local:{PYSPARK_JARS}/*',
    'spark.executor.instances=1',
    'spark.executor.cores=2',
    'spark.executor.memory=512m',
    'spark.driver.memory=512m',
    'spark.yarn.am.memory=512m',
    'spark.ui.enabled=false',
)


class MiniYarn:
  """``env`` is what a YARN client's process needs (HADOOP_CONF_DIR, and
  JAVA_HOME, which the containers' launch scripts read); ``stop()`` ends
  the clusters and, with the NodeManager, its containers."""

  def __init__(self, directory: str, timeout: float = 180):
    jars = processes.read_classpath(CLASSPATH, 'yarn-minicluster')
    java = processes.java()
    self.java_home = os.path.dirname(os.path.dirname(os.path.realpath(java)))
    self.directory = directory
    os.makedirs(directory, exist_ok=True)
    self.log_path = os.path.join(directory, 'miniyarn.log')
    self.process = processes.start(
        [java, '-Xmx768m', '-XX:+UseSerialGC',
         '-Dorg.slf4j.simpleLogger.defaultLogLevel=warn', '-cp', jars,
         os.path.join(YARN_DIR, 'MiniYarn.java'), directory],
        self.log_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        cwd=directory, env={**os.environ, 'JAVA_HOME': self.java_home})
    try:
      found = json.loads(self._first_line(timeout))
    except BaseException:
      self.stop()
      raise
    self.conf_dir = found['conf_dir']
    self.rm_address = found['rm']
    self.webapp = found['webapp']
    self.hdfs = found['hdfs']
    # Beam's HDFS options for the runner's Python side (WebHDFS).
    self.webhdfs_port = found['webhdfs_port']
    self.hdfs_options = ['--hdfs_host=127.0.0.1',
                         f'--hdfs_port={self.webhdfs_port}']
    self.env = {'HADOOP_CONF_DIR': self.conf_dir, 'JAVA_HOME': self.java_home}

  def _first_line(self, timeout: float) -> str:
    found: list = []
    reader = threading.Thread(
        target=lambda: found.append(self.process.stdout.readline()),
        daemon=True)
    reader.start()
    reader.join(timeout)
    if not found or not found[0]:
      raise processes.ServiceError(
          f'MiniYARNCluster did not start within {timeout:g} s; the end of '
          f'its log ({self.log_path}):\n{self.log()}')
    return found[0].decode('utf-8')

  def applications(self) -> list[dict]:
    """The ResourceManager's applications (its REST API)."""
    with urllib.request.urlopen(
        f'http://{self.webapp}/ws/v1/cluster/apps', timeout=30) as response:
      apps = json.load(response).get('apps') or {}
    return apps.get('app', [])

  def hdfs_status(self, path: str) -> dict | None:
    """WebHDFS's FileStatus of ``path``, None if there is none."""
    url = (f'http://127.0.0.1:{self.webhdfs_port}/webhdfs/v1{path}'
           '?op=GETFILESTATUS')
    try:
      with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)['FileStatus']
    except urllib.error.HTTPError as exn:
      if exn.code == 404:
        return None
      raise

  def container_logs(self, app_id: str) -> dict[str, str]:
    """Each container of ``app_id``: its stderr (the NodeManager keeps
    finished containers' logs, MiniYarn.java's delete delay)."""
    found = {}
    for root, _, files in os.walk(os.path.join(self.directory, 'target')):
      if os.path.basename(os.path.dirname(root)) == app_id and (
          'stderr' in files):
        with open(os.path.join(root, 'stderr'), 'rb') as f:
          found[os.path.basename(root)] = f.read().decode('utf-8', 'replace')
    return found

  def log(self) -> str:
    return processes.log_tail(self.log_path)

  def stop(self) -> None:
    if self.process.stdin and not self.process.stdin.closed:
      try:
        self.process.stdin.close()  # MiniYarn shuts down when it closes
      except OSError:
        pass
    try:
      # Its own shutdown stops the NodeManager's containers (20 s here).
      self.process.wait(60)
    except subprocess.TimeoutExpired:
      processes.stop(self.process)
