"""Kafka streaming on the streaming engine: Beam's Java ``ReadFromKafka``
(an unbounded splittable DoFn on the Java harness) under ``--streaming``,
through a real job server, against a real Kafka broker.

One job (streaming Kafka jobs take minutes here, so one run asserts it
all), tests/kafka_stream_job.py: Kafka -> parse -> 2 s windows -> count ->
an idempotent sink. Kafka's console producer writes the topic at a steady
rate the whole time. The job:

- emits window counts while the producer still writes;
- survives its job server's SIGKILL: the next server resumes it from the
  runner's checkpoint (the Kafka offsets are in the committed
  restrictions);
- reads a partition added while it runs (KafkaIO's partition watch, a
  Watch SDF, is an endpoint too);
- lists one endpoint per partition on the status page, named by its
  topic and partition (the restriction's KafkaSourceDescriptor row);
- after the producer stops and the job is drained, every window's count
  equals what the broker holds for that window (the records' LogAppendTime
  as Kafka's console consumer reads them back): none lost, none counted
  twice across the kill.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import urllib.request

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from beam_pyspark.local.expansion import ExpansionService
from beam_pyspark.local.kafka import KafkaBroker
from jobserver_process import JobServerProcess

import kafka_stream_job as job

TESTS = os.path.dirname(os.path.abspath(__file__))
TOPIC = 'events'
RATE = 10  # records a second
JobState = beam_job_api_pb2.JobState


class SteadyProducer:
  """Kafka's console producer fed RATE records a second by a thread,
  keys cycling so that every partition gets records."""
  def __init__(self, broker: KafkaBroker):
    self.process = broker.producer(TOPIC)
    self.sent = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    started = time.monotonic()
    while not self._stop.is_set():
      due = int((time.monotonic() - started) * RATE)
      lines = ''.join(f'k{i % 12}\tproducer-{i}\n'
                      for i in range(self.sent, due))
      if lines:
        self.process.stdin.write(lines.encode())
        self.process.stdin.flush()
        self.sent = due
      self._stop.wait(0.05)

  def stop(self) -> int:
    """Stops writing; waits for the producer to flush and exit; how many
    records it was given."""
    self._stop.set()
    self._thread.join()
    self.process.stdin.close()
    assert self.process.wait(60) == 0
    return self.sent


def _server(root) -> JobServerProcess:
  # Each server runs the job at once (the first while the client expands
  # the Kafka read, the second resuming it): Spark warms up meanwhile.
  return JobServerProcess(root, env={'PYTHONPATH': TESTS},
                          spark_warm_up=True)


def _state(server, job_id):
  return server.job_stub.GetState(
      beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state


def _status(server, job_id) -> dict:
  with urllib.request.urlopen(
      f'{server.status_url}api/jobs/{job_id}', timeout=30) as r:
    return json.load(r)


def _wait(what, until, server, timeout=300, every=1.0, job_id=None):
  """Polls ``until`` while the server lives and, given ``job_id``, while
  its job has not failed (a failed job is said at once, not at the
  timeout)."""
  deadline = time.monotonic() + timeout
  while True:
    found = until()
    if found:
      return found
    assert server.proc.poll() is None, server.log()
    if job_id is not None:
      assert _state(server, job_id) not in (
          JobState.FAILED, JobState.CANCELLED), f'{what}:\n{server.log()}'
    assert time.monotonic() < deadline, f'{what}:\n{server.log()}'
    time.sleep(every)


def _committed(checkpoint) -> int:
  directory = os.path.join(checkpoint, 'manifests')
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return max((int(n) for n in names if n.isdigit()), default=-1)


def _partition_endpoints(server, job_id) -> list[str]:
  """The status page's endpoints that read a partition of TOPIC."""
  streaming = _status(server, job_id).get('streaming') or {}
  return sorted({
      e['position'] for e in streaming.get('endpoints', {}).values()
      if (e.get('position') or '').startswith(f'{TOPIC}/')})


@pytest.fixture
def broker_and_service(tmp_path):
  """The broker and Kafka's expansion service, started side by side (each
  is a JVM that takes 10-30 s to listen here)."""
  (tmp_path / 'xkafka').mkdir()
  started = {}

  def start_service():
    try:
      started['service'] = ExpansionService('kafka', str(tmp_path / 'xkafka'))
    except BaseException as exn:  # pylint: disable=broad-except
      started['error'] = exn

  thread = threading.Thread(target=start_service)
  thread.start()
  kafka = None
  try:
    kafka = KafkaBroker(str(tmp_path / 'kafka'))
    kafka.create_topic(TOPIC, 2, message_timestamp_type='LogAppendTime')
  finally:
    thread.join()
    if kafka is None or 'error' in started:
      if 'service' in started:
        started['service'].stop()
      if kafka is not None:
        kafka.stop()
  if 'error' in started:
    raise started['error']
  try:
    yield kafka, started['service']
  finally:
    started['service'].stop()
    kafka.stop()


def test_streaming_kafka_job_counts_exactly_across_a_job_server_kill(
    tmp_path, broker_and_service):
  from beam_pyspark.jobservice.recovery import StreamingRecovery
  broker, kafka_service = broker_and_service
  root, out = tmp_path / 'server', tmp_path / 'out'
  out.mkdir()
  producer = SteadyProducer(broker)
  first = _server(root)
  servers = [first]
  try:
    p = beam.Pipeline(options=PipelineOptions([
        '--runner=PortableRunner', f'--job_endpoint={first.job_endpoint}',
        '--environment_type=beam:env:embedded_python:v1', '--streaming',
        '--max_records_per_batch=200', '--job_name=kafka-stream']))
    job.build(p, broker.bootstrap, TOPIC, kafka_service.address, str(out))
    job_id = p.run()._job_id  # pylint: disable=protected-access
    checkpoint = StreamingRecovery(str(root)).owned(job_id)

    # Windows fire while the producer writes.
    _wait('no window fired while the producer wrote',
          lambda: job.read_counts(str(out)), first, job_id=job_id)
    assert producer.process.poll() is None
    # SIGKILL after a micro-batch committed past the first output.
    seen = _committed(checkpoint)
    _wait('no micro-batch committed', lambda: _committed(checkpoint) > seen,
          first, job_id=job_id)
    first.proc.kill()
    first.proc.wait(30)
    killed_at = _committed(checkpoint)
    first.stop()

    second = _server(root)
    servers.append(second)
    _wait('the job did not resume',
          lambda: _state(second, job_id) == JobState.RUNNING and
          _committed(checkpoint) > killed_at, second)
    # A partition added while it runs is read, and named on the status page.
    broker.add_partitions(TOPIC, 3)
    names = _wait(
        'the status page never listed three partition endpoints',
        lambda: len(_partition_endpoints(second, job_id)) == 3 and
        _partition_endpoints(second, job_id), second)
    assert names == [f'{TOPIC}/{i}' for i in range(3)]
    time.sleep(3)  # records to the new partition
    produced = producer.stop()
    stored = broker.timestamps(TOPIC, produced)
    assert len(stored) == produced
    by_partition = collections.Counter(partition for partition, _ in stored)
    assert sorted(by_partition) == [0, 1, 2], by_partition
    width = job.WINDOW_SECS * 1000
    expected = dict(sorted(collections.Counter(
        ms - ms % width for _, ms in stored).items()))

    # The running job catches up: each window's last (accumulated) pane is
    # its whole count. (KafkaIO's watermark runs ahead of a partition that
    # is behind, so some windows first fire a partial on-time pane; their
    # records then come as late panes.) Then it drains: a drain truncates
    # an unbounded Kafka restriction (Beam's default), so what was not read
    # before it stays unread: the drain comes after the catch-up, as a
    # user's would.
    _wait('the job did not catch up with the producer',
          lambda: _last_panes(out) == expected, second, job_id=job_id)
    second.job_stub.Drain(beam_job_api_pb2.DrainJobRequest(job_id=job_id))
    _wait('the job did not drain',
          lambda: _state(second, job_id) == JobState.DRAINED, second)
  finally:
    if producer.process.poll() is None:
      producer.process.kill()
    for server in servers:
      server.stop()
  assert _last_panes(out) == expected


def _last_panes(out) -> dict[int, int]:
  return {w: c[-1] for w, c in job.read_counts(str(out)).items()}


def test_an_opaque_schema_row_is_named_by_its_leading_string_and_integer():
  """Java's SchemaCoder reaches the runner as a serialized Java object, so
  the runner reads a KafkaSourceDescriptor's row without its schema: Beam's
  row encoding (here Python's RowCoder, the same wire format) of a row
  whose first set fields are the topic and the partition."""
  import typing
  from apache_beam.coders import RowCoder
  from apache_beam.typehints import schemas
  from beam_pyspark.worker.endpoints import _opaque_row_label

  schema = schemas.named_fields_to_schema([
      ('topic', str), ('partition', int),
      ('start_read_offset', typing.Optional[int]),
      ('bootstrap_servers', typing.Optional[typing.List[str]])])
  coder = RowCoder(schema)
  encoded = coder.encode(beam.Row(
      topic='events', partition=300, start_read_offset=None,
      bootstrap_servers=None))
  assert _opaque_row_label(encoded) == 'events/300'
  assert _opaque_row_label(b'\x01\x00\xff') is None  # not a row
  assert _opaque_row_label(b'') is None
