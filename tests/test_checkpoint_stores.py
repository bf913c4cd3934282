"""Streaming checkpoints on HDFS and on an S3-protocol server (issue 31).

Real servers on loopback (tests/storage_servers.py): Apache Hadoop's
MiniDFSCluster (hdfs://; the runner's Python side through WebHDFS, Spark's
JVM through Hadoop's own client) and moto's S3 server (s3://, reached
with Beam's S3 options). On each: the store's guarantees (a whole file or
none, a manifest committed once), then the driver-kill job of
test_streaming_recovery.py with its checkpoint there, killed mid-batch
and started again, its output equal to Beam's DirectRunner's; and on
HDFS a job server SIGKILLed under a streaming job, whose next start
resumes it from HDFS.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from beam_pyspark.spark.checkpoints import CheckpointDir
from beam_pyspark.storage import Location
from beam_pyspark.storage import checked
from beam_pyspark.storage import storage_options
from beam_pyspark.streaming.checkpoints import ManifestBook
from jobserver_process import JobServerProcess
from storage_servers import MiniHdfs
from storage_servers import MotoS3
import streaming_recovery_job as job

HERE = os.path.dirname(os.path.abspath(__file__))
EMBEDDED = 'beam:env:embedded_python:v1'
RESUMED = 'Resumed from its checkpoint after the job server restarted: '


@pytest.fixture(scope='module')
def hdfs(tmp_path_factory):
  server = MiniHdfs(str(tmp_path_factory.mktemp('hdfs')))
  yield server
  server.stop()


@pytest.fixture(scope='module')
def s3(tmp_path_factory):
  server = MotoS3(str(tmp_path_factory.mktemp('s3')))
  yield server
  server.stop()


@pytest.fixture(params=['hdfs', 's3'])
def server(request):
  return request.getfixturevalue(request.param)


def _job_options(flags: list[str]) -> dict:
  """Pipeline flags as the Job API carries them."""
  found = {}
  for flag in flags:
    name, value = flag[2:].split('=', 1)
    found[f'beam:option:{name}:v1'] = value
  return found


def _location(server, path: str) -> Location:
  return Location.parse(server.url(path),
                        storage_options(_job_options(server.options)))


# -- the store ------------------------------------------------------------------


def test_a_store_writes_whole_files_and_commits_each_name_once(server):
  url = server.url(f'store-{uuid.uuid4().hex[:8]}')
  location = checked(url, storage_options(_job_options(server.options)))
  store = location.store()
  assert store.isdir('')
  store.write('state/n/0/a', b'one')
  store.write('state/n/0/a', b'two')  # a write replaces
  assert store.read('state/n/0/a') == b'two'
  store.commit('manifests/0', b'first')
  with pytest.raises(FileExistsError):
    store.commit('manifests/0', b'a zombie driver\'s')
  assert store.read('manifests/0') == b'first'
  assert [n for n in store.listdir('manifests') if n.isdigit()] == ['0']
  # No temporary name is left behind.
  assert sorted(n for n in store.files('state')
                if not n.endswith('.keep')) == ['state/n/0/a']
  with pytest.raises(FileNotFoundError):
    store.read('state/n/0/missing')
  store.remove('state/n/0/a', 'state/n/0/missing')
  assert not store.exists('state/n/0/a')
  store.rmtree()
  assert not store.isdir('')


def test_a_checkpoint_resumes_from_its_manifests_and_sweeps_the_rest(server):
  location = _location(server, f'dir-{uuid.uuid4().hex[:8]}')
  directory = CheckpointDir(location)
  book = ManifestBook('fp')
  book.changed(('state', 'n', 0), directory.write_file(0, b'zero'))
  directory.commit(book.commit(0, {'now': 5}))
  orphan = directory.write_file(1, b'never committed')
  again = CheckpointDir(location)
  manifests = again.manifests()
  assert [m.batch for m in manifests] == [0]
  resumed = ManifestBook('fp', manifests)
  again.sweep(resumed.live())
  assert again.read_file(resumed.file_of(('state', 'n', 0))) == b'zero'
  assert not location.store().exists(orphan)
  again.delete()
  assert not location.store().isdir('')


# -- a streaming job's driver killed ---------------------------------------------

_REFERENCE: dict = {}


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """Beam's DirectRunner's output of the driver-kill job (TestStream)."""
  if not _REFERENCE:
    out = tmp_path_factory.mktemp('direct')
    with beam.Pipeline('DirectRunner', options=PipelineOptions(
        ['--streaming', '--allow_unsafe_triggers'])) as p:
      job.build(p, str(out))
    _REFERENCE['out'] = (job.read_output(str(out)), job.read_files(str(out)))
    assert len(_REFERENCE['out'][0]) > 20
  return _REFERENCE['out']


def _start(out, checkpoint, *flags):
  return subprocess.Popen(
      [sys.executable, os.path.join(HERE, 'streaming_recovery_job.py'),
       str(out), checkpoint, *flags],
      cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process, timeout=300):
  try:
    _, err = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    _, err = process.communicate()
    raise AssertionError(f'the job did not finish:\n{err[-3000:]}')
  return process.returncode, err


def test_driver_killed_mid_batch_resumes_from_the_store_with_exact_output(
    tmp_path, server, reference):
  out = tmp_path / 'out'
  out.mkdir()
  url = server.url(f'job-{uuid.uuid4().hex[:8]}')
  location = _location(server, url.split('/', 3)[3])
  flags = ('--kill-mid-batch', *server.options)
  code, err = _finish(_start(out, url, *flags))
  assert code == -signal.SIGKILL, err[-3000:]
  assert (out / 'killed').exists()
  store = location.store()
  assert [n for n in store.listdir('manifests') if n.isdigit()], (
      'nothing was committed')
  if isinstance(server, MiniHdfs):
    # Spark's own query checkpoint is on HDFS too.
    assert store.listdir('query/offsets'), store.files('')
  else:
    assert 'kept on the driver\'s disk' in err, err[-3000:]
  assert not os.path.exists(os.path.join(HERE, url.split(':')[0] + ':'))
  code, err = _finish(_start(out, url, *flags))
  assert code == 0, err[-3000:]
  marker = 'Resuming after micro-batch '
  resumed = [line for line in err.splitlines() if marker in line]
  assert resumed, err[-3000:]
  assert int(resumed[-1].split(marker)[1].split(',')[0]) >= 2
  assert (job.read_output(str(out)), job.read_files(str(out))) == reference
  assert not store.isdir(''), 'a DONE job keeps no checkpoint'


# -- a job server killed under a streaming job on HDFS ------------------------------


def _committed(store) -> list[int]:
  return sorted(int(n) for n in store.listdir('manifests') if n.isdigit())


def test_a_job_server_killed_resumes_its_streaming_job_from_hdfs(
    tmp_path, hdfs):
  reference_out = tmp_path / 'direct'
  reference_out.mkdir()
  with beam.Pipeline('DirectRunner') as p:
    job.build_sums(p, str(reference_out))
  expected = job.read_output(str(reference_out))
  assert len(expected) > 20
  root, out = tmp_path / 'server', tmp_path / 'out'
  out.mkdir()
  url = hdfs.url(f'server-{uuid.uuid4().hex[:8]}')
  store = _location(hdfs, url.split('/', 3)[3]).store()
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
    first.proc.kill()
    first.proc.wait(30)
  finally:
    first.stop()
  killed_at = max(_committed(store))

  second = JobServerProcess(root, env={'PYTHONPATH': HERE})
  try:
    deadline = time.monotonic() + 240
    while True:
      state = second.job_stub.GetState(
          beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
      if state == beam_job_api_pb2.JobState.DONE:
        break
      assert state in (beam_job_api_pb2.JobState.STARTING,
                       beam_job_api_pb2.JobState.RUNNING), second.log()
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
