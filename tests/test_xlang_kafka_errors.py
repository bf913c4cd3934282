"""A Kafka read that cannot work fails, naming what it read from.

Beam's Java KafkaIO (through its expansion service, as
tests/test_xlang_kafka.py) says "Could not find any partitions info" for a
topic that does not exist and "Timeout expired while fetching topic
metadata" for a broker that is not there: neither names the topic nor the
address. The job's error must name both (read from the KafkaIO read's
configuration in the pipeline), and come within a bounded time.
"""

from __future__ import annotations

import socket
import time

import pytest

import apache_beam as beam
from apache_beam.io.kafka import ReadFromKafka
from apache_beam.options.pipeline_options import PipelineOptions

from beam_pyspark.local.expansion import ExpansionService
from beam_pyspark.local.kafka import KafkaBroker

# Generous: Kafka's own timeouts (default.api.timeout.ms, 60 s) plus a
# Java harness's start on a busy machine.
BOUND_SECS = 150


@pytest.fixture(scope='module')
def broker(tmp_path_factory):
  kafka = KafkaBroker(str(tmp_path_factory.mktemp('kafka')))
  yield kafka
  kafka.stop()


@pytest.fixture(scope='module')
def kafka_service(tmp_path_factory):
  service = ExpansionService('kafka', str(tmp_path_factory.mktemp('xkafka')))
  yield service
  service.stop()


def read(bootstrap: str, topic: str, service,
         **config: str) -> tuple[str, float]:
  """Runs a bounded read of ``topic`` (more consumer ``config`` given);
  its error's text and how long the job took to fail."""
  options = PipelineOptions(['--runner=beam_pyspark.PySparkRunner',
                             '--spark_master_url=local[2]'])
  start = time.monotonic()
  with pytest.raises(Exception) as failure:
    with beam.Pipeline(options=options) as p:
      _ = (p
           | 'Read' >> ReadFromKafka(
               consumer_config={'bootstrap.servers': bootstrap,
                                'auto.offset.reset': 'earliest', **config},
               topics=[topic], max_num_records=5,
               expansion_service=service.address)
           | beam.Map(print))
  return str(failure.value), time.monotonic() - start


def test_a_missing_topic_fails_naming_the_topic_and_the_broker(
    broker, kafka_service):
  text, secs = read(broker.bootstrap, 'no-such-topic', kafka_service)
  assert 'no-such-topic' in text, text[-3000:]
  assert broker.bootstrap in text, text[-3000:]
  assert secs < BOUND_SECS, f'failed after {secs:.0f} s:\n{text[-3000:]}'


def test_a_dead_broker_fails_naming_its_address(kafka_service):
  with socket.socket() as s:  # a port nothing listens on
    s.bind(('127.0.0.1', 0))
    dead = f'127.0.0.1:{s.getsockname()[1]}'
  # Kafka waits default.api.timeout.ms (60 s) for a broker to answer; the
  # setting the docs point to fails the job sooner.
  text, secs = read(dead, 'some-topic', kafka_service,
                    **{'default.api.timeout.ms': '10000'})
  assert 'Timeout expired' in text, text[-3000:]
  assert dead in text and 'some-topic' in text, text[-3000:]
  assert secs < BOUND_SECS, f'failed after {secs:.0f} s:\n{text[-3000:]}'


def test_kafka_reads_are_found_in_the_expanded_pipeline(kafka_service):
  """What the error names comes from the Java-serialized read
  (planning.kafkaio), for several topics and servers; other transforms
  are not taken for reads."""
  from beam_pyspark.planning.kafkaio import KafkaRead
  from beam_pyspark.planning.kafkaio import kafka_reads
  p = beam.Pipeline()
  _ = p | 'Numbers' >> beam.Create([1, 2]) | beam.Map(str)
  _ = p | 'Orders' >> ReadFromKafka(
      consumer_config={'bootstrap.servers': 'k1:9092,k2:9093'},
      topics=['orders', 'orders-eu'], max_num_records=1,
      expansion_service=kafka_service.address)
  assert kafka_reads(p.to_runner_api()) == [
      KafkaRead('Orders', ('orders', 'orders-eu'), 'k1:9092,k2:9093')]
