"""Streaming checkpoints on an S3-protocol server (issue 31).

moto's S3 server on loopback (beam_pyspark/local/stores.py), reached with
Beam's S3 options: the store's guarantees (a whole object or none, a
manifest committed once with S3's conditional PUT), then the driver-kill
job of test_streaming_recovery.py (a TestStream into windowed sums under
early, on-time and late firings, a stateful DoFn with a timer, Beam's
file sink) with its checkpoint on s3://, its driver SIGKILLed mid-batch
and started again as on another host (without Spark's own query
checkpoint, which stays on the driver's disk: no s3a in pyspark, and the
job says so): it goes on from its manifests on S3, and its output equals
Beam's DirectRunner's. HDFS and a job server's restart: test_checkpoint_hdfs.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from beam_pyspark.local.stores import MotoS3
from checkpoint_store_checks import check_checkpoint_dir
from checkpoint_store_checks import check_store
from checkpoint_store_checks import location
import streaming_recovery_job as job

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope='module')
def s3(tmp_path_factory):
  server = MotoS3(str(tmp_path_factory.mktemp('s3')))
  yield server
  server.stop()


def test_a_store_on_s3_writes_whole_objects_and_commits_each_name_once(s3):
  check_store(s3)


def test_a_checkpoint_on_s3_resumes_from_its_manifests(s3):
  check_checkpoint_dir(s3)


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


def test_driver_killed_mid_batch_resumes_from_s3_with_exact_output(
    tmp_path, s3):
  reference = tmp_path / 'direct'
  reference.mkdir()
  with beam.Pipeline('DirectRunner', options=PipelineOptions(
      ['--streaming', '--allow_unsafe_triggers'])) as p:
    job.build(p, str(reference))
  expected = job.read_output(str(reference)), job.read_files(str(reference))
  assert len(expected[0]) > 20 and len(expected[1]) >= 3
  out = tmp_path / 'out'
  out.mkdir()
  path = f'job-{uuid.uuid4().hex[:8]}'
  url, store = s3.url(path), location(s3, path).store()
  flags = ('--kill-mid-batch', *s3.options)
  code, err = _finish(_start(out, url, *flags))
  assert code == -signal.SIGKILL, err[-3000:]
  assert (out / 'killed').exists()
  assert [n for n in store.listdir('manifests') if n.isdigit()], (
      'nothing was committed')
  assert 'kept on the driver\'s disk' in err, err[-3000:]
  assert not os.path.exists(os.path.join(HERE, 's3:'))
  # The driver starts again on another host: Spark's own query checkpoint
  # (on the dead driver's disk) is not there; the job goes on from the
  # runner's manifests on S3.
  query, _ = location(s3, path).query_checkpoint()
  assert os.path.isdir(os.path.join(query, 'offsets'))
  shutil.rmtree(query)
  code, err = _finish(_start(out, url, *flags))
  assert code == 0, err[-3000:]
  marker = 'Resuming after micro-batch '
  resumed = [line for line in err.splitlines() if marker in line]
  assert resumed, err[-3000:]
  assert int(resumed[-1].split(marker)[1].split(',')[0]) >= 2
  assert (job.read_output(str(out)), job.read_files(str(out))) == expected
  assert not store.isdir(''), 'a DONE job keeps no checkpoint'
