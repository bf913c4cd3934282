"""A real Apache Kafka broker for tests: one KRaft node on loopback.

Not a test module: tests/test_xlang_kafka.py starts one per module. Kafka's
own jars (org.apache.kafka:kafka_2.13 and kafka-tools 4.x, resolved by
`make sdk-xlang` into ~/.m2; classpath in sdks/xlang/broker/target) run as
Kafka's scripts run them: ``kafka.tools.StorageTool format`` once, then
``kafka.Kafka server.properties``; topics are made and read with Kafka's
own command-line classes (``TopicCommand``, ``ConsoleProducer``,
``ConsoleConsumer``). Nothing is mocked.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import uuid

import pytest

from xlang_sdk import BROKER_CLASSPATH_FILE
from xlang_sdk import java
from xlang_sdk import read_classpath
from xlang_sdk import stop_process
from xlang_sdk import wait_listening


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class KafkaBroker:
  """One node that is broker and controller; ``bootstrap`` is its address."""

  def __init__(self, directory: str, start_timeout: float = 180):
    self.directory = directory
    os.makedirs(directory, exist_ok=True)
    self.classpath = read_classpath(BROKER_CLASSPATH_FILE)
    self.port = free_port()
    controller = free_port()
    self.bootstrap = f'127.0.0.1:{self.port}'
    self.properties = os.path.join(directory, 'server.properties')
    with open(self.properties, 'w', encoding='utf-8') as f:
      f.write('\n'.join([
          'process.roles=broker,controller',
          'node.id=1',
          f'controller.quorum.voters=1@127.0.0.1:{controller}',
          f'listeners=PLAINTEXT://127.0.0.1:{self.port},'
          f'CONTROLLER://127.0.0.1:{controller}',
          f'advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}',
          'controller.listener.names=CONTROLLER',
          'inter.broker.listener.name=PLAINTEXT',
          'listener.security.protocol.map='
          'CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT',
          f'log.dirs={os.path.join(directory, "data")}',
          # One node: every internal topic with one replica.
          'offsets.topic.replication.factor=1',
          'offsets.topic.num.partitions=4',
          'transaction.state.log.replication.factor=1',
          'transaction.state.log.min.isr=1',
          'share.coordinator.state.topic.replication.factor=1',
          'share.coordinator.state.topic.min.isr=1',
          'group.initial.rebalance.delay.ms=0',
          'num.partitions=1',
          'auto.create.topics.enable=false',
      ]) + '\n')
    self.log_path = os.path.join(directory, 'kafka.log')
    cluster_id = base64.urlsafe_b64encode(
        uuid.uuid4().bytes).decode().rstrip('=')
    self._run_tool(['kafka.tools.StorageTool', 'format', '-t', cluster_id,
                    '-c', self.properties], 'format')
    env = dict(os.environ)
    self._log = open(self.log_path, 'wb')
    self.process = subprocess.Popen(
        [java(), '-Xmx512m', '-XX:+UseSerialGC',
         '-Dorg.slf4j.simpleLogger.defaultLogLevel=warn',
         '-cp', self.classpath, 'kafka.Kafka', self.properties],
        stdout=self._log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True)
    self._wait_ready(start_timeout)

  def _wait_ready(self, timeout: float) -> None:
    wait_listening(self.process, self.port, timeout, 'Kafka', self.log_tail,
                   self.stop, every=0.3)

  def log_tail(self, chars: int = 6000) -> str:
    try:
      with open(self.log_path, 'rb') as f:
        return f.read().decode('utf-8', 'replace')[-chars:]
    except OSError:
      return ''

  def _run_tool(self, args: list[str], what: str, stdin: bytes = b'',
                timeout: float = 180) -> str:
    proc = subprocess.run(
        [java(), '-Xmx256m', '-XX:+UseSerialGC', '-XX:TieredStopAtLevel=1',
         '-Dorg.slf4j.simpleLogger.defaultLogLevel=warn', '-cp', self.classpath, *args],
        input=stdin, capture_output=True, timeout=timeout, check=False)
    out = proc.stdout.decode('utf-8', 'replace')
    if proc.returncode != 0:
      pytest.fail(f'Kafka {what} exited with {proc.returncode}:\n{out}\n'
                  f'{proc.stderr.decode("utf-8", "replace")[-4000:]}')
    return out

  def create_topic(self, name: str, partitions: int, **config: str) -> None:
    """``config``: topic configs, dots as underscores
    (``message_timestamp_type='LogAppendTime'``)."""
    configs = [a for k, v in config.items()
               for a in ('--config', f'{k.replace("_", ".")}={v}')]
    self._run_tool([
        'org.apache.kafka.tools.TopicCommand', '--bootstrap-server',
        self.bootstrap, '--create', '--topic', name, '--partitions',
        str(partitions), '--replication-factor', '1', *configs
    ], f'topic {name}')

  def add_partitions(self, name: str, partitions: int) -> None:
    """Grows the topic to ``partitions`` partitions."""
    self._run_tool([
        'org.apache.kafka.tools.TopicCommand', '--bootstrap-server',
        self.bootstrap, '--alter', '--topic', name, '--partitions',
        str(partitions)
    ], f'alter {name}')

  def producer(self, topic: str) -> subprocess.Popen:
    """Kafka's console producer, running: each ``key\tvalue`` line
    written to its stdin is a record (it sees a topic's new partitions
    within a second)."""
    return subprocess.Popen(
        [java(), '-Xmx256m', '-XX:+UseSerialGC', '-XX:TieredStopAtLevel=1',
         '-cp', self.classpath, 'org.apache.kafka.tools.ConsoleProducer',
         '--bootstrap-server', self.bootstrap, '--topic', topic,
         '--property', 'parse.key=true', '--property', 'key.separator=\t',
         '--producer-property', 'metadata.max.age.ms=1000',
         '--producer-property', 'linger.ms=0'],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)

  def timestamps(self, topic: str, count: int,
                 timeout_ms: int = 60000) -> list[tuple[int, int]]:
    """(partition, record timestamp in ms) of the topic's first ``count``
    records, as Kafka stores them."""
    out = self._run_tool([
        'org.apache.kafka.tools.consumer.ConsoleConsumer',
        '--bootstrap-server', self.bootstrap, '--topic', topic,
        '--from-beginning', '--max-messages', str(count), '--timeout-ms',
        str(timeout_ms), '--property', 'print.timestamp=true',
        '--property', 'print.partition=true', '--property',
        'print.value=false'
    ], f'consume from {topic}')
    found = []
    for line in out.splitlines():
      fields = dict(f.split(':', 1) for f in line.split('\t') if ':' in f)
      stamp = fields.get('LogAppendTime', fields.get('CreateTime'))
      if stamp is not None and 'Partition' in fields:
        found.append((int(fields['Partition']), int(stamp)))
    return found

  def describe_partitions(self, name: str) -> int:
    out = self._run_tool([
        'org.apache.kafka.tools.TopicCommand', '--bootstrap-server',
        self.bootstrap, '--describe', '--topic', name
    ], f'describe {name}')
    return sum(1 for line in out.splitlines() if 'Partition: ' in line)

  def produce(self, topic: str, records: list[tuple[str, str]]) -> None:
    """Writes key/value records with Kafka's console producer (keys spread
    them over the partitions)."""
    lines = ''.join(f'{k}\t{v}\n' for k, v in records).encode()
    self._run_tool([
        'org.apache.kafka.tools.ConsoleProducer', '--bootstrap-server',
        self.bootstrap, '--topic', topic, '--property', 'parse.key=true',
        '--property', 'key.separator=\t'
    ], f'produce to {topic}', stdin=lines)

  def consume(self, topic: str, count: int,
              timeout_ms: int = 60000) -> list[tuple[str, str]]:
    """The topic's first ``count`` records, from the beginning."""
    out = self._run_tool([
        'org.apache.kafka.tools.consumer.ConsoleConsumer',
        '--bootstrap-server', self.bootstrap, '--topic', topic,
        '--from-beginning', '--max-messages', str(count), '--timeout-ms',
        str(timeout_ms), '--property', 'print.key=true', '--property',
        'key.separator=\t'
    ], f'consume from {topic}')
    records = []
    for line in out.splitlines():
      if '\t' in line:
        key, value = line.split('\t', 1)
        records.append((key, value))
    return records

  def stop(self) -> None:
    stop_process(self.process)
    self._log.close()
