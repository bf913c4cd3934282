"""Spark on YARN (issue 42), as docs/guide/clusters.md's YARN section says.

A real ResourceManager and NodeManager (Hadoop's MiniYARNCluster 3.5.0, the
Hadoop client pyspark 4.3 bundles) with HDFS beside it, on this machine
(tests/yarn_cluster.py). pyspark's own jars hold spark-yarn_2.13 of its
version, so Spark needs nothing added: the cluster's HADOOP_CONF_DIR and
spark.yarn.jars naming pyspark's jars (local:, present on the node).
Executors run in YARN containers with this virtualenv's Python.

The page's commands, run as written but for the cluster's size and this
machine's paths: Beam's wordcount in client mode (against the
DirectRunner's output), a program in cluster mode through spark-submit
(it runs in the ApplicationMaster's container), and the job server on
YARN serving Python jobs (an embedded harness with a staged wheel from
the driver's artifact server, a PROCESS harness) and Beam's Java WordCount
(its harness booted in an executor's container; against the Java
DirectRunner's output). And a streaming job checkpointing on HDFS whose
executor's container is killed mid-batch: YARN gives Spark a new
container, and the output is exactly the DirectRunner's.

In `make test` (which runs `make yarn-minicluster`); without the
MiniYARNCluster's classpath its tests fail saying so, never skip.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

import apache_beam as beam
import psutil
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from docs_blocks import ShellServer
from docs_blocks import block
from docs_blocks import localize
from docs_blocks import run_shell
from packages import write_wheel
from test_sdk_java import direct_counts  # pylint: disable=unused-import
from test_sdk_java import submit_wordcount
from test_sdk_java import wordcount_input  # pylint: disable=unused-import
from yarn_cluster import CLASSPATH
from yarn_cluster import MiniYarn
from yarn_cluster import SPARK_CONF
import streaming_recovery_job as job

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EMBEDDED = 'beam:env:embedded_python:v1'
# docs/guide/clusters.md's YARN blocks are read where they run, by the
# page's name and their first lines, literally (tests/test_docs_blocks.py
# finds them so). The page's application sizes, cut to this one small
# NodeManager (4 GiB): one executor of one core (Spark's default on YARN).
SIZES = {'spark.executor.instances=4': 'spark.executor.instances=1',
         'spark.executor.memory=4g': 'spark.executor.memory=512m'}

@pytest.fixture(scope='module')
def yarn(tmp_path_factory):
  # A missing cluster is a broken set-up, never a reason to skip (as the
  # Java SDK's classpath: tests/java_sdk.py).
  if not os.path.exists(CLASSPATH):
    pytest.fail(f'{CLASSPATH} is missing: run `make yarn-minicluster` (make '
                'test does) to resolve Hadoop\'s MiniYARNCluster with Maven.')
  cluster = MiniYarn(str(tmp_path_factory.mktemp('yarn')))
  yield cluster
  cluster.stop()


def _yarn_args(*extra) -> list[str]:
  args = ['--runner=beam_pyspark.PySparkRunner', '--spark_master_url=yarn']
  for conf in SPARK_CONF:
    args += ['--spark_conf', conf]
  return args + list(extra)


def _env(yarn) -> dict:
  # This checkout first on the driver's PYTHONPATH: Spark's YARN client
  # puts the submitting process's PYTHONPATH before pyspark.zip in the
  # containers' (the AM's and the executors'), so they import the same
  # beam_pyspark.
  path = os.pathsep.join(
      p for p in (REPO, os.environ.get('PYTHONPATH')) if p)
  return {**os.environ, **yarn.env, 'PYTHONPATH': path,
          'PYSPARK_PYTHON': sys.executable}


def _page_env(yarn) -> dict:
  """A reader's shell on a YARN client host: an activated venv (its bin/
  first on PATH), nothing of the cluster's but what the page exports, and
  this checkout first on PYTHONPATH (see _env)."""
  env = {k: v for k, v in _env(yarn).items()
         if k not in ('HADOOP_CONF_DIR', 'PYSPARK_PYTHON')}
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  return env


@pytest.fixture(scope='module')
def page_setup(yarn) -> str:
  """The page's exports (HADOOP_CONF_DIR, PYSPARK_JARS), with this
  cluster's configuration directory: what each of its commands runs
  after."""
  return localize(
      block('docs/guide/clusters.md',
            'export HADOOP_CONF_DIR=/etc/hadoop/conf'),
      {'/etc/hadoop/conf': yarn.conf_dir}) + '\n'


def _run(args, env, log_path, timeout=420) -> str:
  with open(log_path, 'wb') as log:
    proc = subprocess.run([sys.executable, *args], env=env, stdout=log,
                          stderr=subprocess.STDOUT, timeout=timeout,
                          check=False)
  with open(log_path, 'rb') as f:
    text = f.read().decode('utf-8', 'replace')
  if proc.returncode != 0:
    pytest.fail(f'{args[:3]} exited with {proc.returncode}:\n{text[-8000:]}')
  return text


def _new_applications(yarn, before) -> list[dict]:
  known = {app['id'] for app in before}
  return [app for app in yarn.applications() if app['id'] not in known]


def _read_lines(prefix) -> list[str]:
  return sorted(line.rstrip('\n') for path in glob.glob(str(prefix) + '*')
                for line in open(path, encoding='utf-8'))


def _python_ran_in_a_container(yarn, app_id) -> bool:
  """Whether an executor container (not the AM, _000001) of ``app_id`` ran
  Python tasks."""
  logs = yarn.container_logs(app_id)
  return any(
      'PythonRunner' in text for name, text in logs.items()
      if not name.endswith('_000001'))


def test_wordcount_in_client_mode_writes_what_the_direct_runner_writes(
    yarn, page_setup, tmp_path):
  words = 'the quick brown fox jumps over lazy dog beam spark yarn'.split()
  shared = tmp_path / 'shared'
  shared.mkdir()
  (shared / 'input.txt').write_text(''.join(
      ' '.join(words[(i * 7 + j) % len(words)] for j in range(i % 9 + 1))
      + '\n' for i in range(500)))
  before = yarn.applications()
  run_shell(
      page_setup + localize(
          block('docs/guide/clusters.md',
                'python -m apache_beam.examples.wordcount '
                '--runner=beam_pyspark.PySparkRunner \\'),
          {**SIZES, '/shared/data/': f'{shared}/'}),
      tmp_path / 'yarn.log', env=_page_env(yarn), cwd=tmp_path)
  _run(['-m', 'apache_beam.examples.wordcount',
        '--input', str(shared / 'input.txt'),
        '--output', str(tmp_path / 'direct' / 'counts'),
        '--runner=DirectRunner'], _env(yarn), str(tmp_path / 'direct.log'))
  expected = _read_lines(tmp_path / 'direct' / 'counts')
  assert len(expected) == len(words)
  assert _read_lines(shared / 'counts') == expected
  # It ran on YARN: one application, finished well, whose executor's
  # container ran the Python tasks.
  apps = _new_applications(yarn, before)
  assert [(a['state'], a['finalStatus']) for a in apps] == [
      ('FINISHED', 'SUCCEEDED')], apps
  assert _python_ran_in_a_container(yarn, apps[0]['id'])


def test_cluster_mode_runs_the_pipeline_program_in_the_application_master(
    yarn, page_setup, tmp_path):
  program = tmp_path / 'program.py'
  program.write_text(
      'import os, sys\n'
      'import apache_beam as beam\n'
      'from apache_beam.options.pipeline_options import PipelineOptions\n'
      # Where the driver runs: the NodeManager names each container's.
      'open(sys.argv[2], "w").write(os.environ["CONTAINER_ID"])\n'
      'with beam.Pipeline(options=PipelineOptions(sys.argv[3:])) as p:\n'
      '  _ = (p | beam.Create(range(30)) | beam.Map(lambda x: (x % 3, x))\n'
      '       | beam.GroupByKey()\n'
      '       | beam.MapTuple(lambda k, vs: f"{k} {sum(vs)}")\n'
      '       | beam.io.WriteToText(sys.argv[1]))\n')
  out = tmp_path / 'out' / 'part'
  before = yarn.applications()
  # The page's spark-submit; my_pipeline.py is the program above, with
  # where it writes.
  run_shell(
      page_setup + localize(
          block('docs/guide/clusters.md',
                'spark-submit --master yarn --deploy-mode cluster \\'),
          {**SIZES,
           'my_pipeline.py': f'{program} {out} {tmp_path / "driver"}'}),
      tmp_path / 'submit.log', env=_page_env(yarn), cwd=tmp_path)
  assert _read_lines(out) == ['0 135', '1 145', '2 155']
  apps = _new_applications(yarn, before)
  assert [(a['state'], a['finalStatus']) for a in apps] == [
      ('FINISHED', 'SUCCEEDED')], apps
  # The program ran in the application's first container, the AM's.
  driver = (tmp_path / 'driver').read_text()
  assert driver.endswith('_000001'), driver
  assert apps[0]['id'].split('_', 1)[1] in driver, (driver, apps[0]['id'])


def _wait_for_marker(path, proc, log_path, timeout=300) -> dict:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        text = f.read()
      if text:
        return json.loads(text)
    if proc.poll() is not None:
      pytest.fail(f'the job ended before stalling at {path}:\n'
                  f'{open(log_path, "rb").read().decode()[-6000:]}')
    time.sleep(0.2)
  pytest.fail(f'no task stalled at {path} in {timeout}s')


def test_streaming_job_gives_exact_output_after_its_executor_container_is_killed(
    yarn, tmp_path):
  """An unbounded splittable read over micro-batches into windowed sums, a
  stateful DoFn and Beam's file sink (tests/streaming_recovery_job.py); the
  executor's container JVM SIGKILLed in the middle of a micro-batch. YARN
  reports the container lost, Spark asks it for another and retries the
  batch's tasks there: the output is exactly the DirectRunner's. The
  checkpoint is on the cluster's HDFS."""
  reference = tmp_path / 'direct'
  reference.mkdir()
  with beam.Pipeline('DirectRunner', options=PipelineOptions([])) as p:
    job.build(p, str(reference), source='sdf')
  out = tmp_path / 'yarn'
  out.mkdir()
  markers = tmp_path / 'markers'
  markers.mkdir()
  log_path = str(tmp_path / 'streaming.log')
  # On the cluster's HDFS, where a driver restarted on another node would
  # find it.
  checkpoint = f'{yarn.hdfs}/checkpoints/{tmp_path.name}'
  before = yarn.applications()
  with open(log_path, 'wb') as log:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, 'streaming_recovery_job.py'),
         str(out), checkpoint, '--source=sdf', f'--stall={markers}',
         *yarn.hdfs_options, *_yarn_args()[1:]],
        env=_env(yarn), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
  try:
    stalled = _wait_for_marker(str(markers / 'executor'), proc, log_path)
    executor = next(
        parent for parent in psutil.Process(stalled['pid']).parents()
        if 'YarnCoarseGrainedExecutorBackend' in ' '.join(parent.cmdline()))
    executor.kill()
    proc.wait(420)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(30)
  with open(log_path, 'rb') as f:
    text = f.read().decode('utf-8', 'replace')
  assert proc.returncode == 0, text[-8000:]
  assert 'Exit status: 137' in text, text[-8000:]  # YARN saw it killed
  assert len(job.read_output(str(reference))) > 20
  assert job.read_output(str(out)) == job.read_output(str(reference))
  assert job.read_files(str(out)) == job.read_files(str(reference))
  # The job checkpointed on HDFS (it made the directory) and, DONE, keeps
  # no checkpoint there.
  assert yarn.hdfs_status('/checkpoints')['type'] == 'DIRECTORY'
  assert yarn.hdfs_status(f'/checkpoints/{tmp_path.name}') is None
  # A second executor container took the first one's place.
  apps = _new_applications(yarn, before)
  assert len(apps) == 1, apps
  executors = [name for name in yarn.container_logs(apps[0]['id'])
               if not name.endswith('_000001')]
  assert len(executors) == 2, executors


# -- the job server on YARN ---------------------------------------------------
# Last in the module: its application holds a container for the AM and one
# for the executor until the module ends, room the tests above need.


@pytest.fixture(scope='module')
def job_server(yarn, page_setup, tmp_path_factory):
  """The page's job server on YARN, for the module's portable jobs (one
  application and one start for all of them), and the ResourceManager's
  applications before it started."""
  directory = tmp_path_factory.mktemp('jobserver')
  before = yarn.applications()
  server = ShellServer(
      page_setup + localize(
          block('docs/guide/clusters.md',
                'beam-pyspark job-server --spark-master-url yarn \\'),
          {**SIZES,
           # Free ports and no Spark before the first job, as the suite's
           # other servers (tests/jobserver_process.py).
           '--artifacts-dir /var/lib/beam-pyspark':
               f'--artifacts-dir {directory / "lib"} --job-port 0 '
               '--artifact-port 0 --expansion-port 0 --status-port 0 '
               '--no-spark-warm-up'}),
      str(directory / 'server.log'), env=_page_env(yarn))
  try:
    yield server, before
  finally:
    server.stop()


def _server_application(yarn, before) -> str:
  """The job server's application: the one running of those the
  ResourceManager got since the server started, all its jobs' (one
  SparkContext). A start that lost Spark's UI race (spark/session.py's
  _create) leaves one more, ended."""
  apps = _new_applications(yarn, before)
  running = [app for app in apps if app['state'] == 'RUNNING']
  assert len(running) == 1 and len(apps) <= 2, apps
  return running[0]['id']


def test_job_server_on_yarn_serves_staged_wheels_and_boots_process_harnesses(
    yarn, job_server, tmp_path):
  server, before = job_server
  wheel = write_wheel(tmp_path, 'yarn_staged_pkg', '1.0',
                      "GREETING = 'staged on yarn'\n")
  client = ['--runner=PortableRunner',
            f'--job_endpoint={server.endpoints["job"]}']
  # Embedded harnesses in the executors; the wheel only the artifact
  # server the driver runs has: the containers must reach it.
  out = tmp_path / 'embedded' / 'out'
  with beam.Pipeline(options=PipelineOptions(
      client + [f'--environment_type={EMBEDDED}', '--extra_package', wheel])
                     ) as p:
    _ = (p | beam.Create(['a', 'b'])
         | beam.Map(lambda x: f'{x}: {__import__("yarn_staged_pkg").GREETING}')
         | beam.io.WriteToText(str(out)))
  assert _read_lines(out) == ['a: staged on yarn', 'b: staged on yarn']
  # A PROCESS harness, booted by the executor in its container.
  out = tmp_path / 'process' / 'out'
  command = f'{sys.executable} -m apache_beam.runners.worker.sdk_worker_main'
  with beam.Pipeline(options=PipelineOptions(
      client + ['--environment_type=PROCESS',
                '--environment_config=' + json.dumps({'command': command})])
                     ) as p:
    _ = (p | beam.Create(range(30)) | beam.Map(lambda x: (x % 3, x))
         | beam.GroupByKey()
         | beam.MapTuple(lambda k, vs: f'{k} {sum(vs)}')
         | beam.io.WriteToText(str(out)))
  assert _read_lines(out) == ['0 135', '1 145', '2 155']
  logs = yarn.container_logs(_server_application(yarn, before))
  assert any('sdk_worker_main' in text for name, text in logs.items()
             if not name.endswith('_000001')), sorted(logs)


class _JavaHarnesses(threading.Thread):
  """Every Java SDK harness seen running on this machine while it runs:
  its pid, the YARN container it belongs to (CONTAINER_ID, which the
  NodeManager sets in each container's environment), and whether a YARN
  executor's JVM is among its ancestors. Only read, never signalled:
  other tests' harnesses run here too."""

  def __init__(self):
    super().__init__(daemon=True)
    self.found: dict[int, tuple] = {}
    self.done = threading.Event()

  def run(self):
    while not self.done.is_set():
      for proc in psutil.process_iter(['cmdline']):
        if 'org.apache.beam.fn.harness.FnHarness' not in (
            proc.info['cmdline'] or ()):
          continue
        try:
          container = proc.environ().get('CONTAINER_ID')
          executor = any('YarnCoarseGrainedExecutorBackend' in
                         ' '.join(parent.cmdline())
                         for parent in proc.parents())
        except psutil.Error:
          continue  # gone, or another user's
        self.found[proc.pid] = (container, executor)
      self.done.wait(0.2)


def test_java_wordcount_through_the_job_server_on_yarn(
    yarn, job_server, wordcount_input, direct_counts, tmp_path):
  """Beam's Java WordCount, PROCESS: each executor boots Beam's Java
  harness in its own container (python -m beam_pyspark.boot java, the jars
  the Java client staged with the job server, fetched from the driver's
  artifact server) and the counts are the Java DirectRunner's."""
  server, before = job_server
  harnesses = _JavaHarnesses()
  harnesses.start()
  try:
    counts = submit_wordcount(
        server.endpoints['job'], wordcount_input, tmp_path,
        '--defaultEnvironmentType=PROCESS',
        '--defaultEnvironmentConfig='
        '{"command": "python -m beam_pyspark.boot java"}')
  finally:
    harnesses.done.set()
    harnesses.join(30)
  assert counts == direct_counts
  app = _server_application(yarn, before)
  # The harness ran in an executor's container of the server's application
  # (not the AM's, _000001), under the executor's JVM, and logged to that
  # container's stderr.
  app_number = app.split('_', 1)[1]
  ours = [(container, executor)
          for container, executor in harnesses.found.values()
          if container and app_number in container]
  assert ours, harnesses.found
  assert all(not container.endswith('_000001') and executor
             for container, executor in ours), ours
  logs = yarn.container_logs(app)
  assert any('SDK Fn Harness started' in text for name, text in logs.items()
             if not name.endswith('_000001')), sorted(logs)
  # The server's --spark-conf pairs started its context: no job was told
  # they were not applied (spark/session.py's not_applied).
  with open(server.log_path, encoding='utf-8', errors='replace') as f:
    assert 'settings are not applied' not in f.read()
