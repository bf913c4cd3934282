"""``beam-pyspark local kafka|hdfs|s3|expansion-services`` as a user runs
them (docs/local-services.md): each started as a process, its one line
parsed, the service used for real with what the line says to paste, then
Ctrl-C (SIGINT): it exits 0 within seconds, saying so, with no traceback.
Kafka's and HDFS's are the servers of tests/test_xlang_kafka.py and
tests/test_checkpoint_hdfs.py, used by their tests and interrupted at
their modules' ends.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import grpc
import pytest
from apache_beam.portability.api import beam_expansion_api_pb2
from apache_beam.portability.api import beam_expansion_api_pb2_grpc

from checkpoint_store_checks import check_store
from local_command import ROOT
from local_command import LocalCommand


def test_s3_keeps_checkpoints_with_the_options_it_prints(tmp_path):
  """(HDFS: tests/test_checkpoint_hdfs.py's store is `beam-pyspark local
  hdfs`, checked the same way, and stopped with Ctrl-C at its end.)"""
  command = LocalCommand('s3', '--port', '0', '--dir', str(tmp_path))
  try:
    # The runner's own store (s3fs) with the pasted options: whole writes,
    # a commit made once, listings, removal.
    check_store(command.pasted())
  finally:
    command.interrupt()


def test_expansion_services_answer_beams_expansion_api(tmp_path):
  command = LocalCommand('expansion-services', '--sql-port', '0',
                         '--kafka-port', '0', '--dir', str(tmp_path))
  try:
    sql, kafka = (re.search(rf'{name} at (localhost:\d+)', command.line)
                  .group(1) for name in ('Beam SQL', 'KafkaIO'))
    assert f'SqlTransform(..., expansion_service="{sql}")' in command.line
    assert f'ReadFromKafka(..., expansion_service="{kafka}")' in command.line
    found = {}
    for address in (sql, kafka):
      with grpc.insecure_channel(address) as channel:
        answer = beam_expansion_api_pb2_grpc.ExpansionServiceStub(
            channel).DiscoverSchemaTransform(
                beam_expansion_api_pb2.DiscoverSchemaTransformRequest(),
                timeout=120)
      assert not answer.error, answer.error
      found[address] = set(answer.schema_transform_configs)
    assert 'beam:schematransform:org.apache.beam:kafka_read:v1' in found[kafka]
    assert found[sql], 'the SQL service answered with no transforms'
  finally:
    command.interrupt()


@pytest.mark.parametrize('clone', [True, False])
def test_what_is_missing_is_named(clone, tmp_path):
  """Without the Maven-resolved classpath the command names the make
  target that resolves it; outside a clone it says the commands are for a
  clone (checked on a copy of the clone's layout, so the real jars stay)."""
  fake = tmp_path / 'checkout'
  fake.mkdir()
  if clone:
    (fake / 'sdks' / 'xlang').mkdir(parents=True)
    (fake / 'Makefile').write_text('')
  (fake / 'beam_pyspark').symlink_to(os.path.join(ROOT, 'beam_pyspark'))
  proc = subprocess.run(
      [sys.executable, '-m', 'beam_pyspark.cli', 'local', 'hdfs', '--port',
       '0', '--http-port', '0'],
      capture_output=True, cwd=fake, timeout=120, check=False,
      env={**os.environ, 'PYTHONPATH': str(fake)})
  err = proc.stderr.decode()
  assert proc.returncode == 1, err
  assert 'Traceback' not in err, err
  if clone:
    assert 'tests/hdfs/target/classpath.txt is missing: run `make ' \
        'hdfs-minicluster`' in err, err
  else:
    assert 'from a clone of beam-pyspark\'s repository' in err, err
