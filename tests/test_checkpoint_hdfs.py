"""Streaming checkpoints on HDFS (issue 31).

Apache Hadoop's MiniDFSCluster on loopback, started as `beam-pyspark local
hdfs` (docs/local-services.md): the runner's Python side reaches it
through WebHDFS (Beam's --hdfs_host and --hdfs_port), Spark's JVM through
Hadoop's own client (hdfs://). The store's guarantees (a whole file or
none, a manifest committed once: an HDFS rename never replaces), then a
real job server SIGKILLed under a streaming job (an unbounded splittable
read over many micro-batches into windowed sums, an idempotent sink) whose
checkpoint, Spark's query checkpoint included, is on HDFS: the server's
next start resumes the job from HDFS, and its output equals Beam's
DirectRunner's. S3 and a driver killed mid-batch: test_checkpoint_s3.py.
Last, the same store under load: a job whose query's first start fails
as on a loaded machine, while every core is busy (tests/cpu_load.py).
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from checkpoint_store_checks import check_checkpoint_dir
from checkpoint_store_checks import check_store
from checkpoint_store_checks import location
from cpu_load import busy_cores
from cpu_load import run_logged
from cpu_load import slow_first_source_python
from jobserver_process import JobServerProcess
from local_command import LocalCommand
import streaming_recovery_job as job

HERE = os.path.dirname(os.path.abspath(__file__))
EMBEDDED = 'beam:env:embedded_python:v1'
RESUMED = 'Resumed from its checkpoint after the job server restarted: '
JobState = beam_job_api_pb2.JobState


@pytest.fixture(scope='module')
def hdfs(tmp_path_factory):
  """`beam-pyspark local hdfs` as the docs start it: these tests use the
  location and options it prints, and Ctrl-C stops it cleanly at the end
  (docs/local-services.md; one MiniDFSCluster for both purposes)."""
  command = LocalCommand('hdfs', '--port', '0', '--http-port', '0', '--dir',
                         str(tmp_path_factory.mktemp('hdfs')))
  try:
    yield command.pasted()
  finally:
    command.interrupt()


def test_a_store_on_hdfs_writes_whole_files_and_commits_each_name_once(hdfs):
  check_store(hdfs)


def test_a_checkpoint_on_hdfs_resumes_from_its_manifests(hdfs):
  check_checkpoint_dir(hdfs)


def _committed(store) -> list[int]:
  return sorted(int(n) for n in store.listdir('manifests') if n.isdigit())


def test_a_job_server_killed_resumes_its_streaming_job_from_hdfs(
    tmp_path, hdfs):
  reference = tmp_path / 'direct'
  reference.mkdir()
  with beam.Pipeline('DirectRunner') as p:
    job.build_sums(p, str(reference))
  expected = job.read_output(str(reference))
  assert len(expected) > 20
  root, out = tmp_path / 'server', tmp_path / 'out'
  out.mkdir()
  path = f'server-{uuid.uuid4().hex[:8]}'
  url, store = hdfs.url(path), location(hdfs, path).store()
  first = JobServerProcess(root, env={'PYTHONPATH': HERE})
  try:
    p = beam.Pipeline(options=PipelineOptions([
        '--runner=PortableRunner', f'--job_endpoint={first.job_endpoint}',
        f'--environment_type={EMBEDDED}', '--streaming',
        f'--max_records_per_batch={job.SDF_BUDGET}', '--job_name=on-hdfs',
        f'--checkpoint_location={url}', *hdfs.options]))
    job.build_sums(p, str(out))
    job_id = p.run()._job_id  # pylint: disable=protected-access
    deadline = time.monotonic() + 240
    while not [b for b in _committed(store) if b > 0]:
      assert first.proc.poll() is None, first.log()
      assert time.monotonic() < deadline, first.log()
      time.sleep(0.1)
    first.proc.kill()  # the driver dies: SIGKILL, no goodbye
    first.proc.wait(30)
  finally:
    first.stop()
  killed_at = max(_committed(store))
  # Spark's own query checkpoint is on HDFS too.
  assert store.listdir('query/offsets'), store.files('')

  second = JobServerProcess(root, env={'PYTHONPATH': HERE})
  try:
    deadline = time.monotonic() + 240
    while True:
      state = second.job_stub.GetState(
          beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
      if state == JobState.DONE:
        break
      assert state in (JobState.STARTING, JobState.RUNNING), second.log()
      assert time.monotonic() < deadline, second.log()
      time.sleep(0.5)
    texts = [
        r.message_response.message_text
        for r in second.job_stub.GetMessageStream(
            beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=60)
        if r.HasField('message_response')]
  finally:
    second.stop()
  resumed = [t for t in texts if t.startswith(RESUMED)]
  assert resumed and url in resumed[-1], texts
  assert int(resumed[-1].split('micro-batch ')[1].split()[0]) >= killed_at
  assert job.read_output(str(out)) == expected
  assert not store.isdir(''), 'a DONE job keeps no checkpoint'


def test_a_streaming_job_on_hdfs_starts_again_and_is_exact_with_every_core_busy(
    tmp_path, hdfs):
  """The driver-kill job's TestStream job (windowed sums under early,
  on-time and late firings, a stateful DoFn with a timer, Beam's file
  sink), checkpointed on HDFS (Spark's query checkpoint too), while 8
  CPU-bound processes keep both cores busy, in a driver of its own. Its
  query's first start fails as Spark's own does on a loaded machine (the
  source's Python process does not connect back within Spark's 10 s,
  cpu_load.slow_first_source_python): the job starts it again after a
  pause, says why, and its output equals Beam's DirectRunner's."""
  reference = tmp_path / 'direct'
  reference.mkdir()
  with beam.Pipeline('DirectRunner', options=PipelineOptions(
      ['--streaming', '--allow_unsafe_triggers'])) as p:
    job.build(p, str(reference))
  expected = job.read_output(str(reference)), job.read_files(str(reference))
  out = tmp_path / 'out'
  out.mkdir()
  path = f'loaded-{uuid.uuid4().hex[:8]}'
  url, store = hdfs.url(path), location(hdfs, path).store()
  env = dict(os.environ, PYSPARK_PYTHON=slow_first_source_python(
      str(tmp_path)))
  with busy_cores():
    code, log = run_logged(
        [sys.executable, os.path.join(HERE, 'streaming_recovery_job.py'),
         str(out), url, *hdfs.options], str(tmp_path / 'driver.log'),
        timeout=900, cwd=HERE, env=env)
  assert code == 0, log[-6000:]
  assert (tmp_path / 'slow-source').is_dir(), 'the first start was not slow'
  restarts = [line for line in log.splitlines() if 'did not start' in line]
  print(f'{len(restarts)} restarts of the query')
  assert restarts, log[-6000:]
  assert 'connect back within Spark\'s fixed 10 s' in restarts[0]
  assert 'Starting it again in 2 s (start 2)' in restarts[0], restarts
  assert 'Thread State' not in log, log[-6000:]
  assert (out / 'out').is_dir(), log[-6000:]
  assert (job.read_output(str(out)), job.read_files(str(out))) == expected
  assert not store.isdir(''), 'a DONE job keeps no checkpoint'
