"""Spark on YARN (issue 42, its first step: does it run at all).

A real ResourceManager and NodeManager (Hadoop's MiniYARNCluster 3.5.0, the
Hadoop client pyspark 4.3 bundles) with HDFS beside it, on this machine
(tests/yarn_cluster.py). pyspark's own jars hold spark-yarn_2.13 of its
version, so Spark needs nothing added: the cluster's HADOOP_CONF_DIR and
spark.yarn.jars naming pyspark's jars (local:, present on the node).
Executors run in YARN containers with this virtualenv's Python.

Client mode through PySparkRunner (Beam's wordcount, against the
DirectRunner's output) and through the job server (an embedded harness with
a staged wheel from the driver's artifact server, and a PROCESS harness),
cluster mode through spark-submit, and a streaming job whose executor's
container is killed mid-batch: YARN gives Spark a new container, and the
output is exactly the DirectRunner's.

Not part of `make test` yet (issue 42): run `make yarn-minicluster` first;
without it the module is skipped.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import apache_beam as beam
import psutil
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from jobserver_process import JobServerProcess
from packages import write_wheel
from yarn_cluster import CLASSPATH
from yarn_cluster import MiniYarn
from yarn_cluster import SPARK_CONF
import streaming_recovery_job as job

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EMBEDDED = 'beam:env:embedded_python:v1'

pytestmark = pytest.mark.skipif(
    not os.path.exists(CLASSPATH),
    reason=f'{CLASSPATH} is missing: `make yarn-minicluster` resolves '
    'Hadoop\'s MiniYARNCluster (issue 42; not in `make test` yet)')


@pytest.fixture(scope='module')
def yarn(tmp_path_factory):
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
    yarn, tmp_path):
  words = 'the quick brown fox jumps over lazy dog beam spark yarn'.split()
  source = tmp_path / 'in.txt'
  source.write_text(''.join(
      ' '.join(words[(i * 7 + j) % len(words)] for j in range(i % 9 + 1))
      + '\n' for i in range(500)))
  before = yarn.applications()
  _run(['-m', 'apache_beam.examples.wordcount', '--input', str(source),
        '--output', str(tmp_path / 'yarn' / 'counts'),
        *_yarn_args()],
       _env(yarn), str(tmp_path / 'yarn.log'))
  _run(['-m', 'apache_beam.examples.wordcount', '--input', str(source),
        '--output', str(tmp_path / 'direct' / 'counts'),
        '--runner=DirectRunner'], _env(yarn), str(tmp_path / 'direct.log'))
  expected = _read_lines(tmp_path / 'direct' / 'counts')
  assert len(expected) == len(words)
  assert _read_lines(tmp_path / 'yarn' / 'counts') == expected
  # It ran on YARN: one application, finished well, whose executor's
  # container ran the Python tasks.
  apps = _new_applications(yarn, before)
  assert [(a['state'], a['finalStatus']) for a in apps] == [
      ('FINISHED', 'SUCCEEDED')], apps
  assert _python_ran_in_a_container(yarn, apps[0]['id'])


def test_job_server_on_yarn_serves_staged_wheels_and_boots_process_harnesses(
    yarn, tmp_path):
  wheel = write_wheel(tmp_path, 'yarn_staged_pkg', '1.0',
                      "GREETING = 'staged on yarn'\n")
  before = yarn.applications()
  server = JobServerProcess(
      tmp_path / 'jobserver', '--spark-master-url', 'yarn',
      *[arg for conf in SPARK_CONF for arg in ('--spark-conf', conf)],
      env=_env(yarn))
  try:
    client = ['--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}']
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
  finally:
    server.stop()
  # One application for both jobs: the server's SparkContext.
  apps = _new_applications(yarn, before)
  assert len(apps) == 1, apps
  logs = yarn.container_logs(apps[0]['id'])
  assert any('sdk_worker_main' in text for name, text in logs.items()
             if not name.endswith('_000001')), sorted(logs)


def test_cluster_mode_runs_the_pipeline_program_in_the_application_master(
    yarn, tmp_path):
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
  from pyspark.find_spark_home import _find_spark_home
  spark_home = _find_spark_home()
  python = sys.executable
  conf = list(SPARK_CONF) + [
      # The driver (the program) runs in the ApplicationMaster's container.
      f'spark.yarn.appMasterEnv.PYSPARK_PYTHON={python}',
      f'spark.yarn.appMasterEnv.PYSPARK_DRIVER_PYTHON={python}',
  ]
  before = yarn.applications()
  log_path = tmp_path / 'submit.log'
  with open(log_path, 'wb') as log:
    proc = subprocess.run(
        [os.path.join(spark_home, 'bin', 'spark-submit'), '--master', 'yarn',
         '--deploy-mode', 'cluster',
         *[arg for c in conf for arg in ('--conf', c)],
         str(program), str(out), str(tmp_path / 'driver'),
         '--runner=beam_pyspark.PySparkRunner',
         '--spark_master_url=yarn'],
        env={**_env(yarn), 'SPARK_HOME': spark_home}, stdout=log,
        stderr=subprocess.STDOUT, timeout=420, check=False)
  assert proc.returncode == 0, log_path.read_text()[-8000:]
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
