"""The docs' commands and programs that run on this machine, run as written.

Each test reads its blocks from the pages (docs_blocks.block), replaces
only what names the reader's machine (MASTER, JOBSERVER, fixed ports that
tests running in parallel could hold, /data and /var/lib paths) through
``localize``, which fails if a placeholder is gone from the block, and runs
the result with bash (the venv's bin first on PATH, as an activated venv
has it). Outputs are compared with Beam's DirectRunner's.

Grouped for CI: one standalone cluster, started by the Running on a
cluster page's own commands, serves the cluster pages' three blocks in
turn; one job server, started by the README's command, serves the README's
wordcount. tests/test_docs_blocks.py lists which test runs which block.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from docs_blocks import ROOT
from docs_blocks import block
from spark_cluster import StandaloneCluster
from spark_cluster import clean_environment
from spark_cluster import free_port

SAMPLE = str(ROOT / 'examples' / 'data' / 'sample.txt')
_LISTENING = re.compile(r'(Job|Artifact|Expansion) service listening on (.*)$')


def localize(text: str, replacements: dict[str, str]) -> str:
  """The block with the reader's names replaced by this machine's: each
  must be in the block (a page that changed them changes the test too)."""
  for old, new in replacements.items():
    assert old in text, (
        f'{old!r} is no longer in the block:\n{text}\nthe test replaces it '
        f'with {new!r}; update the replacements with the page')
    text = text.replace(old, new)
  return text


def shell_env(extra: dict | None = None) -> dict:
  """An activated venv's environment: its bin/ first (beam-pyspark,
  python)."""
  env = dict(os.environ)
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  env.update(extra or {})
  return env


def run_shell(script: str, log_path, timeout: float = 420, env=None,
              cwd=ROOT) -> str:
  with open(log_path, 'wb') as log:
    proc = subprocess.run(
        ['bash', '-euo', 'pipefail', '-c', script], cwd=cwd, stdout=log,
        stderr=subprocess.STDOUT, timeout=timeout, check=False,
        env=env or shell_env())
  text = open(log_path, encoding='utf-8', errors='replace').read()
  assert proc.returncode == 0, f'{script}\nexited {proc.returncode}:\n' + (
      text[-8000:])
  return text


def counts(prefix: str) -> list[str]:
  lines = []
  for shard in sorted(glob.glob(prefix + '*')):
    with open(shard, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  assert lines, f'no output at {prefix}*'
  return sorted(lines)


@pytest.fixture(scope='module')
def direct_counts(tmp_path_factory) -> list[str]:
  """Beam's wordcount of examples/data/sample.txt on the DirectRunner."""
  from apache_beam.examples import wordcount
  out = str(tmp_path_factory.mktemp('direct') / 'counts')
  wordcount.run([f'--input={SAMPLE}', f'--output={out}',
                 '--runner=DirectRunner'], save_main_session=False)
  return counts(out)


class ShellServer:
  """A job server started by a doc's shell command; its endpoints read
  from its stdout as the CLI prints them."""
  def __init__(self, script: str, log_path: str, env=None, timeout=180):
    self.log_path = log_path
    self._log = open(log_path, 'ab')
    self.proc = subprocess.Popen(
        ['bash', '-c', script], stdout=subprocess.PIPE, stderr=self._log,
        text=True, env=env or shell_env(), start_new_session=True, cwd=ROOT)
    self.endpoints: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    try:
      while len(self.endpoints) < 3 and time.monotonic() < deadline:
        line = self.proc.stdout.readline()
        if not line:
          raise RuntimeError(f'job server exited ({self.proc.wait()}) before '
                             f'listening:\n{self.log()}')
        m = _LISTENING.match(line.strip())
        if m:
          self.endpoints[m.group(1).lower()] = m.group(2)
      assert len(self.endpoints) == 3, self.log()
    except BaseException:
      self.stop()
      raise

  def log(self) -> str:
    with open(self.log_path, encoding='utf-8', errors='replace') as f:
      return f.read()[-6000:]

  def stop(self) -> None:
    try:
      family = [psutil.Process(self.proc.pid)]
      family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
      family = []
    for p in family:  # SIGTERM, as a deployment stops it
      try:
        p.terminate()
      except psutil.NoSuchProcess:
        pass
    _, alive = psutil.wait_procs(family, timeout=60)
    for p in alive:
      p.kill()
    self.proc.wait(30)
    self._log.close()


# -- the README's (and the home page's) ---------------------------------------


def test_the_dataframe_example_runs_as_written(tmp_path):
  """README, docs/index.md, docs/guide/running.md: the same program; run
  over a CSV of its own, the sums are pandas' sums."""
  (text,) = {block(page, 'import apache_beam as beam')
             for page in ('README.md', 'docs/index.md',
                          'docs/guide/running.md')}
  data = tmp_path / 'data'
  data.mkdir()
  for part in range(2):
    with open(data / f'sales{part}.csv', 'w', encoding='utf-8') as f:
      f.write('region,amount\n')
      for i in range(100):
        f.write(f'r{i % 3},{i + part}\n')
  program = localize(text, {"'/data/": f"'{data}/"})
  (tmp_path / 'example.py').write_text(program, encoding='utf-8')
  run_shell('python example.py', tmp_path / 'log', cwd=tmp_path)
  lines = counts(str(data / 'totals'))
  expected = {f'r{r}': sum(i + part for part in range(2) for i in range(100)
                           if i % 3 == r) for r in range(3)}
  rows = dict(l.split(',') for l in lines if not l.startswith('region'))
  assert {k: int(v) for k, v in rows.items()} == expected, lines


@pytest.fixture(scope='module')
def readme_server(tmp_path_factory):
  """The README's job server command, on free ports."""
  (text,) = {block(page, 'beam-pyspark job-server --job-host localhost '
                   '--job-port 8099 \\')
             for page in ('README.md', 'docs/index.md')}
  home = tmp_path_factory.mktemp('readme-server')
  script = localize(text, {
      '8099': str(free_port()), '8098': str(free_port()),
      '8097': str(free_port()), '8090': str(free_port()),
      '~/.beam-pyspark/artifacts': str(home / 'artifacts')})
  server = ShellServer(script, str(home / 'server.log'))
  try:
    yield server
  finally:
    server.stop()


def test_the_readmes_job_server_runs_its_wordcount(
    readme_server, direct_counts, tmp_path):
  (text,) = {block(page, 'python -m apache_beam.examples.wordcount \\')
             for page in ('README.md', 'docs/index.md')}
  script = localize(text, {
      'localhost:8099': readme_server.endpoints['job'],
      '/tmp/counts': str(tmp_path / 'counts')})
  run_shell(script, tmp_path / 'log')
  assert counts(str(tmp_path / 'counts')) == direct_counts


def test_the_sdk_pages_job_server_line_starts(tmp_path):
  """The Go and TypeScript pages' one-line job server start (the Go test
  runs its own server in its place): it listens, then stops on SIGTERM."""
  (text,) = {block('docs/sdks/typescript.md',
                   "beam-pyspark job-server --job-port 8099 --spark-master-url 'local[2]'"),
             block('docs/sdks/go.md', "beam-pyspark job-server --job-port 8099 "
                   "--spark-master-url 'local[2]'").split('\n')[0] + '\n'}
  # The two other ports are the CLI's defaults: free ones instead.
  script = localize(text, {'8099': str(free_port())}).strip() + (
      f' --artifact-port {free_port()} --expansion-port {free_port()}'
      f' --status-port {free_port()} --artifacts-dir {tmp_path / "a"}')
  server = ShellServer(script, str(tmp_path / 'server.log'))
  try:
    assert server.proc.poll() is None, server.log()
  finally:
    server.stop()
  assert server.proc.returncode == 0, server.log()


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


def test_the_job_server_on_the_standalone_cluster(
    cluster, direct_counts, tmp_path):
  server_text, client_text = _server_then_pipeline(block(
      'docs/guide/clusters.md',
      'beam-pyspark job-server --job-host $(hostname -f) \\'))
  server = ShellServer(
      localize(server_text, {
          'spark://MASTER:7077': cluster.url,
          '/var/lib/beam-pyspark': str(tmp_path / 'artifacts')})
      # The page's server takes the default ports: free ones instead.
      + f' --job-port {free_port()} --artifact-port {free_port()}'
      f' --expansion-port {free_port()} --status-port {free_port()}',
      str(tmp_path / 'server.log'), env=cluster.env)
  try:
    (tmp_path / 'requirements.txt').write_text(
        '# the pipeline needs nothing beyond Beam\n', encoding='utf-8')
    from apache_beam.examples import wordcount
    run_shell(localize(client_text, {
        'my_pipeline.py': f'{wordcount.__file__} --input {SAMPLE} '
                          f'--output {tmp_path / "counts"}',
        'JOBSERVER:8099': server.endpoints['job']}),
              tmp_path / 'log', env=cluster.env, cwd=tmp_path)
  finally:
    server.stop()
  assert counts(str(tmp_path / 'counts')) == direct_counts


def test_the_production_job_server_start(cluster, direct_counts, tmp_path):
  """docs/operations/job-server.md's start with every flag, on the
  cluster: it serves a wordcount and keeps its job in the job store."""
  text = block('docs/operations/job-server.md', 'beam-pyspark job-server \\')
  ports = {p: str(free_port()) for p in ('8099', '8098', '8097', '8090')}
  server = ShellServer(
      localize(text, {'spark://MASTER:7077': cluster.url,
                      '/var/lib/beam-pyspark': str(tmp_path / 'lib'),
                      **{f'port {p}': f'port {q}' for p, q in ports.items()}}),
      str(tmp_path / 'server.log'), env=cluster.env)
  try:
    run_shell(
        f'python -m apache_beam.examples.wordcount --input {SAMPLE} '
        f'--output {tmp_path / "counts"} --runner=PortableRunner '
        f'--job_endpoint={server.endpoints["job"]} '
        '--environment_type=beam:env:embedded_python:v1',
        tmp_path / 'log', env=cluster.env)
  finally:
    server.stop()
  assert counts(str(tmp_path / 'counts')) == direct_counts
  assert (tmp_path / 'lib' / 'jobs.sqlite').stat().st_size > 0
