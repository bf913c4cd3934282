"""``beam-pyspark local kafka|hdfs|s3|expansion-services`` as a user runs
them (docs/local-services.md): each started as a process, its one line
parsed, the service used for real with what the line says to paste, then
Ctrl-C (SIGINT): it exits 0 within seconds, saying so, with no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from apache_beam.portability.api import beam_expansion_api_pb2
from apache_beam.portability.api import beam_expansion_api_pb2_grpc

from beam_pyspark.local.kafka import KafkaTools
from beam_pyspark.storage import checked
from beam_pyspark.storage import storage_options
from checkpoint_store_checks import job_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LocalCommand:
  """``beam-pyspark local ARGS`` running; ``line`` is what it printed."""

  def __init__(self, *args: str, timeout: float = 300):
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'beam_pyspark.cli', 'local', *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    found: list = []
    reader = threading.Thread(
        target=lambda: found.append(self.proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not found or not found[0]:
      self.proc.kill()
      _, err = self.proc.communicate(timeout=60)
      pytest.fail(f'beam-pyspark local {args[0]} printed nothing in '
                  f'{timeout} s:\n{err.decode(errors="replace")}')
    self.line = found[0].decode()
    assert self.line.rstrip().endswith('; Ctrl-C stops it'), self.line

  def flags(self) -> list[str]:
    return re.findall(r'(--\w+=\S+)', self.line.replace(';', ' '))

  def interrupt(self) -> None:
    """Ctrl-C: one line saying it stopped, exit 0, no traceback."""
    self.proc.send_signal(signal.SIGINT)
    out, err = self.proc.communicate(timeout=60)
    out, err = out.decode(errors='replace'), err.decode(errors='replace')
    assert self.proc.returncode == 0, (out, err)
    assert 'Traceback' not in err + out, err
    assert re.fullmatch(r'beam-pyspark local \S+: stopped .* \(SIGINT\)\n',
                        out), out


def _pasted_store(command: LocalCommand):
  """The runner's own store (s3fs; fsspec's WebHDFS) at the location and
  with the options the line says to paste."""
  flags = command.flags()
  location = next(f.split('=', 1)[1] for f in flags
                  if f.startswith('--checkpoint_location='))
  others = [f for f in flags if not f.startswith('--checkpoint_location=')]
  return checked(location, storage_options(job_options(others))).store()


@pytest.mark.parametrize('service', ['s3', 'hdfs'])
def test_a_store_keeps_checkpoints_with_the_options_it_prints(
    service, tmp_path):
  ports = ['--port', '0'] + (['--http-port', '0'] if service == 'hdfs' else [])
  command = LocalCommand(service, *ports, '--dir', str(tmp_path))
  try:
    # What a checkpoint needs (the whole set: checkpoint_store_checks, run
    # against the same servers by test_checkpoint_*.py): a write read
    # back, a commit made once.
    store = _pasted_store(command)
    store.write('state/a', b'written with the pasted options')
    assert store.read('state/a') == b'written with the pasted options'
    store.commit('manifests/0', b'first')
    with pytest.raises(FileExistsError):
      store.commit('manifests/0', b'second')
  finally:
    command.interrupt()


def test_kafka_carries_a_record_to_its_topic(tmp_path):
  command = LocalCommand('kafka', '--port', '0', '--topic', 'events:2',
                         '--dir', str(tmp_path))
  try:
    bootstrap = re.search(r'"bootstrap.servers": "([^"]+)"',
                          command.line).group(1)
    assert 'topics: events:2' in command.line, command.line
    tools = KafkaTools(bootstrap)
    tools.produce('events', [('k', 'hello from the docs')])
    assert tools.consume('events', 1) == [('k', 'hello from the docs')]
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
