"""A real Apache Kafka broker: one KRaft node on loopback.

Kafka's own jars (org.apache.kafka:kafka_2.13 and kafka-tools 4.x, resolved
by `make sdk-xlang` into ~/.m2; classpath in sdks/xlang/broker/target) run
as Kafka's scripts run them: ``kafka.tools.StorageTool format`` once, then
``kafka.Kafka server.properties``; topics are made and read with Kafka's
own command-line classes (``TopicCommand``, ``ConsoleProducer``,
``ConsoleConsumer``).
"""

from __future__ import annotations

import base64
import os
import subprocess
import uuid

from beam_pyspark.local import processes
from beam_pyspark.local.processes import ServiceError

MAKE_TARGET = 'sdk-xlang'


def classpath() -> str:
  return processes.read_classpath(processes.in_clone(
      'sdks', 'xlang', 'broker', 'target', 'classpath.txt'), MAKE_TARGET)


class KafkaTools:
  """Kafka's command-line classes against the broker at ``bootstrap``."""

  def __init__(self, bootstrap: str, jars: str | None = None):
    self.bootstrap = bootstrap
    self.classpath = jars or classpath()

  def run_tool(self, args: list[str], what: str, stdin: bytes = b'',
               timeout: float = 180) -> str:
    proc = subprocess.run(
        [processes.java(), '-Xmx256m', '-XX:+UseSerialGC',
         '-XX:TieredStopAtLevel=1',
         '-Dorg.slf4j.simpleLogger.defaultLogLevel=warn', '-cp',
         self.classpath, *args],
        input=stdin, capture_output=True, timeout=timeout, check=False)
    out = proc.stdout.decode('utf-8', 'replace')
    if proc.returncode != 0:
      raise ServiceError(
          f'Kafka {what} exited with {proc.returncode}:\n{out}\n'
          f'{proc.stderr.decode("utf-8", "replace")[-4000:]}')
    return out

  def create_topic(self, name: str, partitions: int, **config: str) -> None:
    """``config``: topic configs, dots as underscores
    (``message_timestamp_type='LogAppendTime'``)."""
    configs = [a for k, v in config.items()
               for a in ('--config', f'{k.replace("_", ".")}={v}')]
    self.run_tool([
        'org.apache.kafka.tools.TopicCommand', '--bootstrap-server',
        self.bootstrap, '--create', '--topic', name, '--partitions',
        str(partitions), '--replication-factor', '1', *configs
    ], f'topic {name}')

  def add_partitions(self, name: str, partitions: int) -> None:
    """Grows the topic to ``partitions`` partitions."""
    self.run_tool([
        'org.apache.kafka.tools.TopicCommand', '--bootstrap-server',
        self.bootstrap, '--alter', '--topic', name, '--partitions',
        str(partitions)
    ], f'alter {name}')

  def describe_partitions(self, name: str) -> int:
    out = self.run_tool([
        'org.apache.kafka.tools.TopicCommand', '--bootstrap-server',
        self.bootstrap, '--describe', '--topic', name
    ], f'describe {name}')
    return sum(1 for line in out.splitlines() if 'Partition: ' in line)

  def producer(self, topic: str) -> subprocess.Popen:
    """Kafka's console producer, running: each ``key\\tvalue`` line
    written to its stdin is a record (it sees a topic's new partitions
    within a second)."""
    return subprocess.Popen(
        [processes.java(), '-Xmx256m', '-XX:+UseSerialGC',
         '-XX:TieredStopAtLevel=1', '-cp', self.classpath,
         'org.apache.kafka.tools.ConsoleProducer',
         '--bootstrap-server', self.bootstrap, '--topic', topic,
         '--property', 'parse.key=true', '--property', 'key.separator=\t',
         '--producer-property', 'metadata.max.age.ms=1000',
         '--producer-property', 'linger.ms=0'],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)

  def produce(self, topic: str, records: list[tuple[str, str]]) -> None:
    """Writes key/value records with Kafka's console producer (keys spread
    them over the partitions)."""
    lines = ''.join(f'{k}\t{v}\n' for k, v in records).encode()
    self.run_tool([
        'org.apache.kafka.tools.ConsoleProducer', '--bootstrap-server',
        self.bootstrap, '--topic', topic, '--property', 'parse.key=true',
        '--property', 'key.separator=\t'
    ], f'produce to {topic}', stdin=lines)

  def _consume(self, topic: str, count: int, timeout_ms: int,
               *properties: str) -> list[str]:
    out = self.run_tool([
        'org.apache.kafka.tools.consumer.ConsoleConsumer',
        '--bootstrap-server', self.bootstrap, '--topic', topic,
        '--from-beginning', '--max-messages', str(count), '--timeout-ms',
        str(timeout_ms),
        *[a for p in properties for a in ('--property', p)]
    ], f'consume from {topic}')
    return out.splitlines()

  def consume(self, topic: str, count: int,
              timeout_ms: int = 60000) -> list[tuple[str, str]]:
    """The topic's first ``count`` records, from the beginning."""
    lines = self._consume(topic, count, timeout_ms, 'print.key=true',
                          'key.separator=\t')
    return [tuple(line.split('\t', 1)) for line in lines if '\t' in line]

  def timestamps(self, topic: str, count: int,
                 timeout_ms: int = 60000) -> list[tuple[int, int]]:
    """(partition, record timestamp in ms) of the topic's first ``count``
    records, as Kafka stores them."""
    found = []
    for line in self._consume(topic, count, timeout_ms,
                              'print.timestamp=true', 'print.partition=true',
                              'print.value=false'):
      fields = dict(f.split(':', 1) for f in line.split('\t') if ':' in f)
      stamp = fields.get('LogAppendTime', fields.get('CreateTime'))
      if stamp is not None and 'Partition' in fields:
        found.append((int(fields['Partition']), int(stamp)))
    return found


class KafkaBroker(KafkaTools, processes.JavaServer):
  """One node that is broker and controller; ``bootstrap`` is its address.

  ``port`` 0 picks a free one; ``auto_create_topics`` lets a first write
  or read make a topic (the tests keep it off: a missing topic is a case
  they test).
  """

  def __init__(self, directory: str, port: int = 0,
               auto_create_topics: bool = False, start_timeout: float = 180):
    os.makedirs(directory, exist_ok=True)
    self.directory = directory
    self.port = processes.port_or_free(port, '--port')
    super().__init__(f'127.0.0.1:{self.port}')
    controller = processes.free_port()
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
          f'auto.create.topics.enable={str(auto_create_topics).lower()}',
      ]) + '\n')
    self.log_path = os.path.join(directory, 'kafka.log')
    cluster_id = base64.urlsafe_b64encode(
        uuid.uuid4().bytes).decode().rstrip('=')
    # --ignore-formatted: a kept directory (--dir) starts again as it was.
    # The id joined to its flag: one starting with '-' (1 in 64 of them)
    # was read as a flag, and the format failed ("expected one argument").
    self.run_tool(['kafka.tools.StorageTool', 'format',
                   f'--cluster-id={cluster_id}',
                   '-c', self.properties, '--ignore-formatted'], 'format')
    self.process = processes.start(
        [processes.java(), '-Xmx512m', '-XX:+UseSerialGC',
         '-Dorg.slf4j.simpleLogger.defaultLogLevel=warn',
         '-cp', self.classpath, 'kafka.Kafka', self.properties],
        self.log_path)
    try:
      processes.wait_listening(self.process, self.port, start_timeout,
                               'Kafka', self.log_path)
    except BaseException:
      self.stop()
      raise
