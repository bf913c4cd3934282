"""Beam's Java SDK on the job server: Beam's own Java WordCount.

``org.apache.beam.examples.WordCount`` from ``beam-examples-java``, submitted
by Java's PortableRunner to ``beam-pyspark job-server``: LOOPBACK on local
Spark (the harness runs in the submitting JVM), and PROCESS on a real
standalone cluster (each executor starts Beam's Java harness with
``python -m beam_pyspark.boot java`` from the jars the pipeline staged).
Both must write what the Java DirectRunner writes for the same input.
The boot's own pieces (classpath, JVM flags, FnHarness's environment) are
tested directly at the end.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import time
import urllib.request

import pytest
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from google.protobuf import struct_pb2

from beam_pyspark.boot import common
from beam_pyspark.boot import java as java_boot
from java_sdk import classpath
from java_sdk import run_java
from java_sdk import staging_records
from jobserver_process import JobServerProcess
from spark_cluster import StandaloneCluster
from spark_cluster import clean_environment

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(os.path.dirname(HERE), 'examples', 'data', 'sample.txt')
WORDCOUNT = 'org.apache.beam.examples.WordCount'
# Same application size as tests/test_cluster.py: two 1-core executors.
APP_CONF = [
    'spark.executor.cores=1', 'spark.cores.max=2',
    'spark.executor.memory=512m', 'spark.driver.memory=512m',
    'spark.ui.enabled=false'
]


def read_counts(prefix: str) -> list[str]:
  lines = []
  for shard in sorted(glob.glob(prefix + '*')):
    with open(shard, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  return sorted(lines)


@pytest.fixture(scope='module')
def wordcount_input(tmp_path_factory) -> str:
  """The shipped sample, repeated with numbered lines: enough words for
  several bundles and shards, small enough to stay quick."""
  with open(SAMPLE, encoding='utf-8') as f:
    sample = f.read().splitlines()
  path = tmp_path_factory.mktemp('wordcount') / 'input.txt'
  with open(path, 'w', encoding='utf-8') as f:
    for copy in range(20):
      for line in sample:
        f.write(f'{line} line{copy % 7}\n')
  return str(path)


@pytest.fixture(scope='module')
def direct_counts(wordcount_input, tmp_path_factory) -> list[str]:
  """The reference: Beam's Java DirectRunner on the same input."""
  out = tmp_path_factory.mktemp('direct')
  run_java(WORDCOUNT, [
      f'--inputFile={wordcount_input}', f'--output={out}/counts',
      '--runner=DirectRunner'], str(out / 'java.log'))
  counts = read_counts(f'{out}/counts')
  assert len(counts) > 50 and all(': ' in c for c in counts), counts[:5]
  return counts


def jobs_detail(server) -> str:
  """Every job's detail from the status page's API, as text."""
  def get(path):
    with urllib.request.urlopen(server.status_url + path, timeout=30) as r:
      return json.load(r)
  return json.dumps([get(f'api/jobs/{urllib.parse.quote(row["job_id"])}')
                     for row in get('api/jobs')])


def submit_wordcount(job_endpoint, wordcount_input, out, *environment):
  run_java(WORDCOUNT, [
      f'--inputFile={wordcount_input}', f'--output={out}/counts',
      '--runner=PortableRunner', f'--jobEndpoint={job_endpoint}',
      *environment], str(out / 'java.log'))
  return read_counts(f'{out}/counts')


@pytest.fixture(scope='module')
def local_server(tmp_path_factory):
  server = JobServerProcess(tmp_path_factory.mktemp('local') / 'artifacts')
  try:
    yield server
  finally:
    server.stop()


def server_staging(server) -> list[dict]:
  with open(server.log_path, encoding='utf-8', errors='replace') as f:
    return staging_records(f.read())


@pytest.fixture(scope='module')
def first_java_job(local_server, wordcount_input, tmp_path_factory):
  """The first Java job on local_server, LOOPBACK: its output and what its
  staging fetched (a fixture, so that the tests relying on a first job
  having staged the classpath run it whatever their order)."""
  before = len(server_staging(local_server))
  counts = submit_wordcount(
      local_server.job_endpoint, wordcount_input,
      tmp_path_factory.mktemp('first-java-job'),
      '--defaultEnvironmentType=LOOPBACK')
  staged = server_staging(local_server)[before:]
  assert len(staged) == 1, staged
  return counts, staged[0]


def test_wordcount_loopback_on_local_spark(first_java_job, direct_counts):
  counts, staged = first_java_job
  assert counts == direct_counts
  # Java's PortableRunner stages the submitting JVM's classpath, jar by jar
  # (whatever an earlier test on this server staged is not fetched again).
  jars = classpath().split(os.pathsep)
  assert staged['artifacts'] == len(jars), (staged, len(jars))
  assert staged['fetched'] + staged['reused'] == len(jars), staged


def test_wordcount_in_javas_default_docker_environment(
    local_server, first_java_job, wordcount_input, direct_counts, tmp_path):
  """With no environment option, Java's environment is Docker
  (apache/beam_java17_sdk:2.62.0); the job server maps Beam's Java images
  to the PROCESS boot, so the pipeline runs unchanged.

  The second job stages the same classpath: the job server holds every jar
  by its sha256 already and asks for none (issue 43: each job sent all of
  them again, 107 MB for Beam's examples)."""
  counts = submit_wordcount(
      local_server.job_endpoint, wordcount_input, tmp_path)
  assert counts == direct_counts
  detail = jobs_detail(local_server)
  assert 'java, process' in detail, detail[-3000:]
  first = first_java_job[1]
  second = server_staging(local_server)[-1]
  assert second['token'] != first['token']
  assert second['artifacts'] == first['artifacts'], (first, second)
  assert second['fetched'] == second['bytes'] == 0, (first, second)
  assert second['reused'] == second['artifacts'], second


def test_a_java_harness_that_cannot_boot_fails_the_job_with_the_boots_words(
    local_server, wordcount_input, tmp_path):
  """The staged jars hold no harness jar: the job FAILS, the boot's reason
  the first line of its error, in its messages and in the Java client's
  exception (issue 40: the error said only 'exited with code 1 ... Check
  the harness command and its log above', the reason was on the job
  server's stderr)."""
  from apache_beam.portability.api import beam_job_api_pb2
  from java_sdk import java
  staged = [jar for jar in classpath().split(os.pathsep)
            if not os.path.basename(jar).startswith('beam-sdks-java-harness')]
  stub = local_server.job_stub
  before = {j.job_id for j in stub.GetJobs(
      beam_job_api_pb2.GetJobsRequest()).job_info}
  out = tmp_path / 'out'
  proc = subprocess.run([
      java(), '-cp', classpath(), WORDCOUNT,
      f'--inputFile={wordcount_input}', f'--output={out}/counts',
      '--runner=PortableRunner',
      f'--jobEndpoint={local_server.job_endpoint}',
      '--defaultEnvironmentType=PROCESS',
      '--defaultEnvironmentConfig='
      '{"command": "python -m beam_pyspark.boot java"}',
      '--filesToStage=' + ','.join(staged)],
      capture_output=True, text=True, timeout=300, check=False)
  reason = 'The staged jars have no beam-sdks-java-harness jar'
  assert proc.returncode != 0, proc.stderr[-3000:]
  assert reason in proc.stderr, proc.stderr[-3000:]
  (job, ) = [j for j in stub.GetJobs(beam_job_api_pb2.GetJobsRequest()).job_info
             if j.job_id not in before]
  assert job.state == beam_job_api_pb2.JobState.FAILED
  errors = [
      r.message_response.message_text for r in stub.GetMessageStream(
          beam_job_api_pb2.JobMessagesRequest(job_id=job.job_id), timeout=60)
      if r.HasField('message_response') and r.message_response.importance ==
      beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_ERROR]
  assert len(errors) == 1, errors
  first = errors[0].splitlines()[0]
  assert 'exited with code 1' in first and reason in first, errors[0]
  assert not glob.glob(f'{out}/counts*')


# A harness that never connects is given up after this long here (180 s by
# default: a JVM loading a large classpath on a loaded machine is slow).
POOL_CONNECT_SECS = 20


def test_a_java_worker_pool_serves_one_job_and_then_its_failure_says_why(
    wordcount_input, direct_counts, tmp_path):
  """Beam's Java worker pool (ExternalWorkerService, as a Java SDK
  container runs it with --worker_pool) behind an EXTERNAL environment:
  its first job's counts are the DirectRunner's. Its harnesses end with
  that job, and each shuts down the executor all the pool's harnesses share
  (FnHarness), so the pool starts no harness for the next job: that job
  ends FAILED in bounded time, its error saying what the pool's log says
  and what to do, never waiting or passing for done."""
  from java_sdk import java
  pool_log = tmp_path / 'pool.log'
  with open(pool_log, 'wb') as log:
    pool = subprocess.Popen(
        [java(), '-cp', classpath(),
         'org.apache.beam.fn.harness.ExternalWorkerService'],
        env={**os.environ, 'PIPELINE_OPTIONS': '{"options": {}}'},
        stdout=log, stderr=subprocess.STDOUT)
  server = JobServerProcess(
      tmp_path / 'artifacts',
      env={'BEAM_PYSPARK_HARNESS_CONNECT_SECS': str(POOL_CONNECT_SECS)})
  try:
    address = _pool_address(pool, pool_log)
    external = ['--defaultEnvironmentType=EXTERNAL',
                f'--defaultEnvironmentConfig={address}']
    first = tmp_path / 'first'
    first.mkdir()
    assert submit_wordcount(server.job_endpoint, wordcount_input, first,
                            *external) == direct_counts
    out = tmp_path / 'second'
    started = time.monotonic()
    proc = subprocess.run([
        java(), '-cp', classpath(), WORDCOUNT,
        f'--inputFile={wordcount_input}', f'--output={out}/counts',
        '--runner=PortableRunner', f'--jobEndpoint={server.job_endpoint}',
        *external], capture_output=True, text=True, timeout=600,
        check=False)
    took = time.monotonic() - started
  finally:
    server.stop()
    pool.kill()
    pool.wait(30)
  assert proc.returncode != 0, proc.stderr[-3000:]
  # The runner's words, and the pool's own.
  assert 'never connected to the runner' in proc.stderr, proc.stderr[-3000:]
  assert 'A Java worker pool' in proc.stderr, proc.stderr[-3000:]
  assert 'RejectedExecutionException' in pool_log.read_text(
      errors='replace'), pool_log.read_text(errors='replace')[-3000:]
  # Asked once, and once more (a pool under load may lose a request).
  assert 2 * POOL_CONNECT_SECS <= took < 2 * POOL_CONNECT_SECS + 120, took
  assert not glob.glob(f'{out}/counts*')


def _pool_address(pool, log_path, timeout: float = 60) -> str:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    found = re.search(r'External worker service started at address: (\S+)',
                      log_path.read_text(errors='replace'))
    if found:
      return found.group(1)
    assert pool.poll() is None, log_path.read_text(errors='replace')
    time.sleep(0.2)
  raise AssertionError(f'no worker pool address in {timeout} s: '
                       + log_path.read_text(errors='replace'))


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
  cluster = StandaloneCluster(
      str(tmp_path_factory.mktemp('cluster')), workers=2, cores=2,
      memory='2g')
  try:
    yield cluster
  finally:
    cluster.stop()


def test_wordcount_process_on_a_standalone_cluster(
    cluster, wordcount_input, direct_counts, tmp_path):
  """The executors start Beam's Java harness themselves: ``python`` in the
  command is the executor's interpreter, the jars are the ones the
  PortableRunner staged (retrieved by the boot over the Fn API)."""
  args = ['--spark-master-url', cluster.url]
  for conf in APP_CONF:
    args += ['--spark-conf', conf]
  server = JobServerProcess(
      tmp_path / 'artifacts', *args, env=clean_environment())
  try:
    counts = submit_wordcount(
        server.job_endpoint, wordcount_input, tmp_path,
        '--defaultEnvironmentType=PROCESS',
        '--defaultEnvironmentConfig='
        '{"command": "python -m beam_pyspark.boot java"}')
    detail = jobs_detail(server)
  finally:
    server.stop()
  assert counts == direct_counts
  assert 'java, process' in detail, detail[-3000:]
  # The harnesses ran in the cluster's executors (FnHarness logs to the
  # executor's stderr), with the options file the boot wrote.
  executor_logs = cluster.logs(200000)
  assert 'SDK Fn Harness started' in executor_logs, executor_logs[-3000:]
  assert 'pipeline_options.json' in executor_logs


# -- the boot's pieces ---------------------------------------------------------


def boot_context(tmp_path, staged_names, options=None, status=''):
  staged = tmp_path / 'staged'
  staged.mkdir(exist_ok=True)
  artifacts = []
  for name in staged_names:
    (staged / name).write_bytes(b'jar')
    artifacts.append(common.RetrievedArtifact(
        str(staged / name), name, beam_runner_api_pb2.ArtifactInformation()))
  pipeline_options = struct_pb2.Struct()
  pipeline_options.update(options or {})
  info = beam_provision_api_pb2.ProvisionInfo(
      pipeline_options=pipeline_options,
      runner_capabilities=['beam:protocol:control_response_elements_embedding:v1'])
  info.status_endpoint.url = status
  return common.BootContext(
      worker_id='worker-7', provision_endpoint='localhost:1',
      control_endpoint='localhost:2', artifact_endpoint='localhost:3',
      logging_endpoint='localhost:4', semi_persist_dir=str(tmp_path),
      info=info, artifacts=artifacts, extra=[])


def test_boot_runs_fnharness_on_the_staged_classpath(tmp_path, monkeypatch):
  monkeypatch.delenv(java_boot.ENV_HARNESS_CLASSPATH, raising=False)
  monkeypatch.delenv(java_boot.ENV_JAVA_OPTS, raising=False)
  ctx = boot_context(
      tmp_path, ['app.jar', 'beam-sdks-java-harness-2.62.0.jar',
                 'jamm-0.4.0.jar'],
      options={'options': {'jdkAddOpenModules': ['java.base/java.nio=ALL-UNNAMED']}},
      status='localhost:5')
  argv, env = java_boot.command(ctx)
  cp = argv[argv.index('-cp') + 1].split(os.pathsep)
  # The staged order is kept (boot.go does): the pipeline's jars first.
  assert [os.path.basename(p) for p in cp] == [
      'app.jar', 'beam-sdks-java-harness-2.62.0.jar', 'jamm-0.4.0.jar']
  assert argv[-1] == 'org.apache.beam.fn.harness.FnHarness'
  assert f'-javaagent:{cp[2]}' in argv
  assert '--add-opens=java.base/java.nio=ALL-UNNAMED' in argv
  assert env['HARNESS_ID'] == 'worker-7'
  assert env['CONTROL_API_SERVICE_DESCRIPTOR'] == 'url: "localhost:2"\n'
  assert env['LOGGING_API_SERVICE_DESCRIPTOR'] == 'url: "localhost:4"\n'
  assert env['STATUS_API_SERVICE_DESCRIPTOR'] == 'url: "localhost:5"\n'
  assert env['RUNNER_CAPABILITIES'] == (
      'beam:protocol:control_response_elements_embedding:v1')
  assert 'PIPELINE_OPTIONS' not in env
  with open(env['PIPELINE_OPTIONS_FILE'], encoding='utf-8') as f:
    assert json.load(f)['options']['jdkAddOpenModules'] == [
        'java.base/java.nio=ALL-UNNAMED']


def test_boot_names_the_harness_classpath_when_nothing_staged_has_it(
    tmp_path, monkeypatch):
  monkeypatch.delenv(java_boot.ENV_HARNESS_CLASSPATH, raising=False)
  ctx = boot_context(tmp_path, ['app.jar'])
  with pytest.raises(common.BootError, match='harness_classpath'):
    java_boot.command(ctx)
  # A directory of the harness's jars, named by the environment variable
  # or the boot's flag, goes ahead of the staged jars.
  harness = tmp_path / 'harness'
  harness.mkdir()
  for name in ('b-harness.jar', 'a-core.jar'):
    (harness / name).write_bytes(b'jar')
  monkeypatch.setenv(java_boot.ENV_HARNESS_CLASSPATH, f'{harness}/*')
  argv, _ = java_boot.command(ctx)
  cp = argv[argv.index('-cp') + 1].split(os.pathsep)
  assert [os.path.basename(p) for p in cp] == [
      'a-core.jar', 'b-harness.jar', 'app.jar']
  monkeypatch.delenv(java_boot.ENV_HARNESS_CLASSPATH)
  ctx.extra = [f'--harness_classpath={harness}', '--jvm_arg=-Xmx300m']
  argv, _ = java_boot.command(ctx)
  assert '-Xmx300m' in argv
  assert len(argv[argv.index('-cp') + 1].split(os.pathsep)) == 3
