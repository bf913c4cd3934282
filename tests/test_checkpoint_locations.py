"""Streaming checkpoint locations, checked at submission, and what a job
says when its checkpoint is removed under it (issue 26).

A real ``beam-pyspark job-server`` subprocess and Beam's PortableRunner
client: each location the runner cannot use (an unknown scheme, one whose
library is not installed, a namenode no one serves, under /proc, under a
regular file) is refused when the job is submitted, naming
``--checkpoint_location``; nothing is made of it (``hdfs://`` used to
become a local directory ``./hdfs:/namenode:8020/ckpt``). A running job
whose checkpoint is deleted fails saying so, and gives no resume hint.
PySparkRunner refuses the same locations before anything runs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from beam_pyspark.errors import InvalidOptionsError
from conftest import spark_options
from jobserver_process import JobServerProcess
from test_jobserver_resume import EMBEDDED
from test_jobserver_resume import TESTS
from test_jobserver_resume import _history
from test_jobserver_resume import _wait_for_commit
import streaming_recovery_job as job


def _bad_locations(tmp_path):
  regular = tmp_path / 'a-file'
  regular.write_text('not a directory')
  found = {
      # A namenode no one serves: refused at once, nothing made locally.
      'hdfs://namenode:8020/ckpt': 'cannot create or write to',
      'ftp://host/ckpt': 'cannot go to ftp://',
      '/proc/beam-pyspark-ckpt': 'cannot create or write to',
      f'{regular}/ckpt': 'NotADirectoryError',
  }
  # The test environment installs the [hdfs] and [s3] extras, not [gcs]:
  # a scheme whose library is missing is refused naming its extra.
  if importlib.util.find_spec('gcsfs') is None:
    found['gs://bucket/ckpt'] = 'beam-pyspark[gcs]'
  return found


def _streaming(p):
  _ = (p | beam.Create([('a', 1), ('b', 2)]) | beam.GroupByKey()
       | beam.Map(str))


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  server = JobServerProcess(tmp_path_factory.mktemp('ckpt') / 'server',
                            env={'PYTHONPATH': TESTS})
  yield server
  server.stop()


def test_bad_locations_are_refused_at_submission(server, tmp_path):
  for location, why in _bad_locations(tmp_path).items():
    p = beam.Pipeline(options=PipelineOptions([
        '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
        f'--environment_type={EMBEDDED}', '--streaming',
        f'--checkpoint_location={location}']))
    _streaming(p)
    started = time.monotonic()
    with pytest.raises(Exception) as info:
      p.run()
    text = str(info.value)
    assert f'--checkpoint_location={location}' in text, text
    assert why in text, text
    assert time.monotonic() - started < 30
  # No job ran: each was refused at Run, and is still a preparation.
  jobs = server.job_stub.GetJobs(beam_job_api_pb2.GetJobsRequest()).job_info
  assert all(j.state == beam_job_api_pb2.JobState.STOPPED for j in jobs)
  assert not os.path.exists('hdfs:') and not os.path.exists('gs:')


def test_the_runner_refuses_them_before_running(tmp_path):
  for location, why in _bad_locations(tmp_path).items():
    p = beam.Pipeline(options=spark_options(streaming=True,
                                            checkpoint_location=location))
    _streaming(p)
    with pytest.raises(InvalidOptionsError) as info:
      p.run()
    assert f'--checkpoint_location={location}' in str(info.value)
    assert why in str(info.value)


def _remove_while_written(path) -> None:
  """rmtree of a directory the running job still writes into: a file it
  made between rmtree's listing and its rmdir ("Directory not empty", in
  a CI run at load 11) goes on the next pass."""
  for _ in range(100):
    shutil.rmtree(path, ignore_errors=True)
    if not path.exists():
      return
    time.sleep(0.05)
  raise AssertionError(f'{path} could not be removed: {os.listdir(path)}')


def test_a_deleted_checkpoint_fails_the_job_without_a_resume_hint(
    server, tmp_path):
  checkpoint, out = tmp_path / 'ckpt', tmp_path / 'out'
  out.mkdir()
  p = beam.Pipeline(options=PipelineOptions([
      '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
      f'--environment_type={EMBEDDED}', '--streaming',
      f'--max_records_per_batch={job.SDF_BUDGET}',
      f'--checkpoint_location=file://{checkpoint}']))
  job.build_sums(p, str(out))
  result = p.run()
  job_id = result._job_id  # pylint: disable=protected-access
  _wait_for_commit(server, str(checkpoint), after=0)
  _remove_while_written(checkpoint)
  states, texts = _history(server, job_id)
  assert states[-1] == beam_job_api_pb2.JobState.FAILED, texts
  text = '\n'.join(texts)
  assert 'removed while the job ran' in text, text
  assert 'every executor must see' not in text
  assert 'to resume from it' not in text
  assert f'checkpoint location {checkpoint} is gone' in text


def test_a_store_out_of_reach_at_restart_says_how_to_resume(tmp_path):
  from beam_pyspark.jobservice.recovery import StreamingRecovery
  from spark_cluster import free_port
  from test_registry import _pipeline
  url = f'webhdfs://127.0.0.1:{free_port()}/ckpt'  # nothing listens there
  said = StreamingRecovery(str(tmp_path)).after_restart(
      'job', _pipeline(), {'beam:option:streaming:v1': True,
                           'beam:option:checkpoint_location:v1': url})
  assert isinstance(said, str), said
  assert 'cannot be read now' in said and 'ConnectionError' in said, said
  assert f'--checkpoint_location={url} to resume' in said


def test_locations_name_their_scheme_and_never_show_their_secrets():
  from beam_pyspark.storage import Location
  location = Location.parse('s3a://bucket/ckpt/', {
      's3_secret_access_key': 'hush', 's3_endpoint_url': 'http://x:1'})
  assert (location.url, location.scheme) == ('s3a://bucket/ckpt', 's3a')
  assert 'hush' not in repr(location)
  # Spark's JVM cannot write s3a:// here: its own checkpoint stays local.
  query, why = location.query_checkpoint()
  assert os.path.isabs(query) and 'driver\'s disk' in why
  hdfs = Location.parse('hdfs://nn:8020/ckpt')
  assert hdfs.query_checkpoint() == ('hdfs://nn:8020/ckpt/query', None)
  assert Location.parse('file:///tmp/x').url == '/tmp/x'
  with pytest.raises(InvalidOptionsError, match='names its bucket'):
    Location.parse('s3:///ckpt')


def test_a_local_checkpoint_commits_each_batch_once(tmp_path):
  """The local store's guarantees, as test_checkpoint_hdfs.py and
  test_checkpoint_s3.py check HDFS's and S3's (the manifest by a hard
  link: never over another driver's)."""
  from checkpoint_store_checks import check_checkpoint_dir
  from checkpoint_store_checks import check_store

  class Local:
    options: list = []

    @staticmethod
    def url(path):
      return str(tmp_path / path)

  check_store(Local)
  check_checkpoint_dir(Local)
