"""Kafka from a Python pipeline, in batch: Beam's Java KafkaIO through its
expansion service, against a real Apache Kafka broker.

The broker is Kafka's own, started as `beam-pyspark local kafka`
(beam_pyspark/local/kafka.py: one KRaft node on loopback, topics of
several partitions). ``WriteToKafka`` and a bounded
``ReadFromKafka`` (``max_num_records``) are expanded by Beam's Java
expansion service (Beam 2.71.0, scripts/expansion-service.sh) into Java
transforms of a PROCESS environment: each executor starts Beam's Java
harness with ``python -m beam_pyspark.boot java`` from the jars the runner
staged; the Python stages stay embedded. One pipeline per runner writes a
topic from Python elements and reads a topic seeded by Kafka's own console
producer: what Kafka's console consumer reads back must equal what was
written, and what the pipeline read must equal what was seeded. Last, a
streaming job reads the seeded topic, its checkpoint on S3, while every
core is busy (tests/cpu_load.py).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys

import pytest

import apache_beam as beam
from apache_beam.io.kafka import ReadFromKafka
from apache_beam.io.kafka import WriteToKafka
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.local.expansion import ExpansionService
from beam_pyspark.local.kafka import KafkaTools
from beam_pyspark.local.stores import MotoS3
from cpu_load import busy_cores
from cpu_load import run_logged
from jobserver_process import JobServerProcess
from local_command import LocalCommand
import kafka_stream_job

PARTITIONS = 3
SEEDED = [(f'key-{i % 7}', f'seeded-{i}') for i in range(60)]
WRITTEN = [(f'w{i % 5}', f'written-{i}') for i in range(40)]


@pytest.fixture(scope='module')
def broker(tmp_path_factory):
  """`beam-pyspark local kafka` as the docs start it: the pipelines and
  Kafka's tools here use the address it prints, and Ctrl-C stops it
  cleanly at the module's end (docs/local-services.md; one broker tests
  both)."""
  command = LocalCommand('kafka', '--port', '0', '--topic',
                         f'seeded:{PARTITIONS}', '--dir',
                         str(tmp_path_factory.mktemp('kafka')))
  try:
    assert f'(topics: seeded:{PARTITIONS})' in command.line, command.line
    kafka = KafkaTools(re.search(r'"bootstrap.servers": "([^"]+)"',
                                 command.line).group(1))
    kafka.produce('seeded', SEEDED)
    yield kafka
  finally:
    command.interrupt()


@pytest.fixture(scope='module')
def kafka_service(tmp_path_factory):
  service = ExpansionService('kafka', str(tmp_path_factory.mktemp('xkafka')))
  yield service
  service.stop()


def read_and_write(options, broker, service, topic: str, out: str):
  """One pipeline: Python elements to ``topic``; the seeded topic, bounded,
  to text. Returns the expanded pipeline's environments."""
  with beam.Pipeline(options=options) as p:
    _ = (
        p
        | 'Records' >> beam.Create(WRITTEN)
        | 'Encode' >> beam.Map(lambda kv: (kv[0].encode(), kv[1].encode())).
        with_output_types(tuple[bytes, bytes])
        | 'Write' >> WriteToKafka(
            producer_config={'bootstrap.servers': broker.bootstrap},
            topic=topic,
            expansion_service=service.address))
    _ = (
        p
        | 'Read' >> ReadFromKafka(
            consumer_config={
                'bootstrap.servers': broker.bootstrap,
                'auto.offset.reset': 'earliest',
            },
            topics=['seeded'],
            max_num_records=len(SEEDED),
            expansion_service=service.address)
        | 'Decode' >> beam.Map(
            lambda kv: json.dumps([kv[0].decode(), kv[1].decode()]))
        | 'Text' >> beam.io.WriteToText(out))
    environments = p.to_runner_api().components.environments
  return environments


def read_text(path: str) -> list:
  rows = []
  for name in glob.glob(path + '*'):
    with open(name, encoding='utf-8') as f:
      rows.extend(tuple(json.loads(line)) for line in f if line.strip())
  return sorted(rows)


def check(broker, topic: str, out: str) -> None:
  assert read_text(out) == sorted(SEEDED)
  assert broker.describe_partitions(topic) == PARTITIONS
  assert sorted(broker.consume(topic, len(WRITTEN))) == sorted(WRITTEN)


def test_kafka_write_and_bounded_read_on_pyspark_runner(
    broker, kafka_service, tmp_path):
  broker.create_topic('from-pyspark-runner', PARTITIONS)
  out = str(tmp_path / 'read')
  environments = read_and_write(
      PipelineOptions([
          '--runner=beam_pyspark.PySparkRunner',
          '--spark_master_url=local[2]',
      ]), broker, kafka_service, 'from-pyspark-runner', out)
  commands = {
      beam_runner_api_pb2.ProcessPayload.FromString(e.payload).command
      for e in environments.values()
      if e.urn == common_urns.environments.PROCESS.urn
  }
  assert commands == {'python -m beam_pyspark.boot java'}
  check(broker, 'from-pyspark-runner', out)


@pytest.fixture(scope='module')
def kafka_service_beam_default(tmp_path_factory):
  """The same service with Beam's default environment: a Docker image,
  which the job server maps to the PROCESS boot by default."""
  service = ExpansionService(
      'kafka', str(tmp_path_factory.mktemp('xkafkad')),
      '--beam-default-environment')
  yield service
  service.stop()


@pytest.fixture(scope='module')
def job_server(tmp_path_factory):
  server = JobServerProcess(tmp_path_factory.mktemp('kafkajs') / 'artifacts')
  yield server
  server.stop()


def test_kafka_write_and_bounded_read_through_the_job_server(
    broker, kafka_service_beam_default, job_server, tmp_path):
  """Through the job server, with an expansion service left at Beam's
  default environment (Docker): the job server's default override runs
  Beam's Java image as the PROCESS boot, which the job's messages say."""
  broker.create_topic('from-job-server', PARTITIONS)
  out = str(tmp_path / 'read')
  options = PipelineOptions([
      '--runner=PortableRunner',
      f'--job_endpoint={job_server.job_endpoint}',
      f'--environment_type={python_urns.EMBEDDED_PYTHON}',
  ])
  environments = read_and_write(options, broker, kafka_service_beam_default,
                                'from-job-server', out)
  # There is no Docker here: the Java stages ran through the override.
  images = {
      beam_runner_api_pb2.DockerPayload.FromString(e.payload).container_image
      for e in environments.values()
      if e.urn == common_urns.environments.DOCKER.urn
  }
  assert images == {'apache/beam_java17_sdk:2.71.0'}
  check(broker, 'from-job-server', out)


def test_a_streaming_kafka_read_checkpointed_on_s3_is_exact_with_every_core_busy(
    broker, kafka_service, tmp_path):
  """A streaming job (--streaming: the streaming engine, micro-batches)
  reads the seeded topic through KafkaIO's Java expansion, its checkpoint
  on an S3 server (moto), in a driver of its own, while CPU-bound
  processes keep both cores busy (at load 30-90 streaming jobs failed
  before their first micro-batch: spark.querystarts): every record once,
  and each key's count, as Kafka holds them."""
  out = tmp_path / 'out'
  out.mkdir()
  s3 = MotoS3(str(tmp_path / 's3'))
  try:
    with busy_cores():
      code, log = run_logged(
          [sys.executable, kafka_stream_job.__file__, str(out),
           broker.bootstrap, 'seeded', str(len(SEEDED)),
           kafka_service.address, '--streaming',
           '--spark_master_url=local[2]',
           f'--checkpoint_location={s3.url("kafka-job")}', *s3.options],
          str(tmp_path / 'driver.log'), timeout=900,
          cwd=os.path.dirname(kafka_stream_job.__file__))
    assert code == 0, log[-6000:]
    assert not s3.filesystem().exists(s3.url('kafka-job')), (
        'a DONE job keeps no checkpoint')
  finally:
    s3.stop()
  restarts = [line for line in log.splitlines() if 'did not start' in line]
  print(f'{len(restarts)} restarts of the query')
  for line in restarts:
    assert 'connect back within Spark\'s fixed 10 s' in line, line
  assert 'kept on the driver\'s disk' in log, log[-3000:]
  counts = collections.Counter(k for k, _ in SEEDED)
  assert kafka_stream_job.read_names(str(out)) == sorted(
      [f'record-{k}-{v}' for k, v in SEEDED] +
      [f'count-{k}-{n}' for k, n in counts.items()])
