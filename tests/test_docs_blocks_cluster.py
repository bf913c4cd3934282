"""The Running on a cluster page's standalone cluster, started and used as
written (docs/guide/clusters.md, docs/operations/job-server.md).

One cluster, started by the page's own master and worker commands (the
pyspark package's bin/spark-class), serves the page's runner command and
then the job server's production start, which also serves the page's
client command (a server's flags there are a subset of the production
start's: checked below). Each client's counts are the DirectRunner's.
Which test runs which block: tests/test_docs_blocks.py.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from docs_blocks import SAMPLE
from docs_blocks import ShellServer
from docs_blocks import block
from docs_blocks import counts
from docs_blocks import direct_wordcount
from docs_blocks import localize
from docs_blocks import run_shell
from docs_blocks import shell_env
from spark_cluster import StandaloneCluster
from spark_cluster import clean_environment
from spark_cluster import free_port


@pytest.fixture(scope='module')
def direct_counts(tmp_path_factory) -> list[str]:
  return direct_wordcount(str(tmp_path_factory.mktemp('direct') / 'counts'))


# -- Running on a cluster: standalone ------------------------------------------


class DocCluster(StandaloneCluster):
  """The standalone page's master and worker, each host's lines in a shell
  of its own (the master's command runs in the foreground, as on its
  host); StandaloneCluster's state, logs and stop."""
  def __init__(self, directory: str, text: str, timeout: float = 180):
    # pylint: disable=super-init-not-called
    self.directory = directory
    self.port, self.ui_port = free_port(), free_port()
    self.url = f'spark://127.0.0.1:{self.port}'
    text = localize(text, {'MASTER': '127.0.0.1', '7077': str(self.port),
                           '8080': str(self.ui_port)})
    home, master, worker = re.split(
        r"^# on the master's host\n|^# on each worker's host\n", text,
        flags=re.M)
    # Not in the commands: Spark's fixed ports that another cluster on this
    # machine may hold (the master's REST server, the worker's UI), and the
    # worker's scratch directory (else under SPARK_HOME, in the venv).
    self.env = clean_environment({
        'PATH': shell_env()['PATH'],
        'PYTHONPATH': os.environ.get('PYTHONPATH', ''),
        'SPARK_MASTER_OPTS': '-Dspark.master.rest.enabled=false',
        'SPARK_WORKER_WEBUI_PORT': str(free_port()),
        'SPARK_WORKER_DIR': os.path.join(directory, 'work')})
    self.procs, self._logs = [], []
    try:
      self._start('master', ['bash', '-c', home + master], {})
      self._start('worker', ['bash', '-c', home + worker], {})
      deadline = time.monotonic() + timeout
      while time.monotonic() < deadline:
        state = self.state()
        if state and state.get('aliveworkers', 0) >= 1:
          return
        for proc in self.procs:
          assert proc.poll() is None, self.logs()
        time.sleep(1)
      raise RuntimeError(f'the worker did not register:\n{self.logs()}')
    except BaseException:
      self.stop()
      raise


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
  cluster = DocCluster(
      str(tmp_path_factory.mktemp('doc-cluster')),
      block('docs/guide/clusters.md', "SPARK_HOME=$(python -c 'from "
            "pyspark.find_spark_home import _find_spark_home as f; "
            "print(f())')"))
  try:
    yield cluster
  finally:
    cluster.stop()


def test_the_runner_on_the_standalone_cluster(
    cluster, direct_counts, tmp_path):
  # The cluster is the page's: 4 cores, 8g on its one worker.
  assert cluster.state()['workers'][0]['cores'] == 4, cluster.state()
  shared = tmp_path / 'shared' / 'data'
  shared.mkdir(parents=True)
  (shared / 'input.txt').write_bytes(open(SAMPLE, 'rb').read())
  script = localize(
      block('docs/guide/clusters.md',
            'python -m apache_beam.examples.wordcount \\'),
      {'spark://MASTER:7077': cluster.url,
       '/shared/data/': f'{shared}/'})
  run_shell(script, tmp_path / 'log', env=cluster.env)
  assert counts(str(shared / 'counts')) == direct_counts


def _server_then_pipeline(text: str) -> tuple[str, str]:
  """A block of a job server start and then a client's command."""
  server, client = re.split(r'\n(?=python )', text.strip('\n'))
  return server, client


def _flags(command: str) -> dict[str, str]:
  words = command.replace('\\\n', ' ').split()
  return {w: words[i + 1] for i, w in enumerate(words)
          if w.startswith('--') and i + 1 < len(words)}


def test_the_job_server_starts_and_serves_the_cluster_pages_client(
    cluster, direct_counts, tmp_path):
  """docs/operations/job-server.md's start with every flag, on the
  cluster, serving the cluster page's client command (--requirements_file
  and all; my_pipeline.py: Beam's wordcount); its job kept in its job
  store. The
  cluster page's own server line is this start with fewer flags (checked:
  one start, not two, for CI's sake)."""
  text = block('docs/operations/job-server.md', 'beam-pyspark job-server \\')
  page_server, client = _server_then_pipeline(block(
      'docs/guide/clusters.md',
      'beam-pyspark job-server --job-host $(hostname -f) \\'))
  production = _flags(text)
  assert _flags(page_server).items() <= production.items(), (
      'the cluster page starts its job server with flags that '
      'docs/operations/job-server.md does not (and this test runs only the '
      'latter): make them a subset again, or run both')
  ports = {p: str(free_port()) for p in ('8099', '8098', '8097', '8090')}
  server = ShellServer(
      localize(text, {'spark://MASTER:7077': cluster.url,
                      '/var/lib/beam-pyspark': str(tmp_path / 'lib'),
                      **{f'port {p}': f'port {q}' for p, q in ports.items()}}),
      str(tmp_path / 'server.log'), env=cluster.env)
  try:
    (tmp_path / 'requirements.txt').write_text(
        '# the pipeline needs nothing beyond Beam\n', encoding='utf-8')
    from apache_beam.examples import wordcount
    run_shell(localize(client, {
        'my_pipeline.py': f'{wordcount.__file__} --input {SAMPLE} '
                          f'--output {tmp_path / "counts"}',
        'JOBSERVER:8099': server.endpoints['job']}),
              tmp_path / 'client.log', env=cluster.env, cwd=tmp_path)
  finally:
    server.stop()
  assert counts(str(tmp_path / 'counts')) == direct_counts
  assert (tmp_path / 'lib' / 'jobs.sqlite').stat().st_size > 0
