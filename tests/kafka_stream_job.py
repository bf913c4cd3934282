"""The streaming Kafka job of tests/test_xlang_kafka_stream.py.

Not a test module: the job server's workers import it (PYTHONPATH), as a
user's installed package would be. Beam's Java ``ReadFromKafka`` (unbounded,
each record stamped with the broker's LogAppendTime, the topic's partitions
watched for growth) -> a Python parse -> 2 s fixed windows (late panes
accumulating, so a window's last pane is its whole count) -> count ->
an idempotent sink: one empty file per pane, named by its window's start
and its count, written through a temporary name and a rename. A pane that a
resumed job fires again writes the same name; a count that differs shows
as a file of its own.

``build_seeded`` (run as ``python kafka_stream_job.py ...``, ``main``):
test_xlang_kafka.py's streaming read of its seeded topic under CPU load.
"""

from __future__ import annotations

import logging
import os
import sys

import apache_beam as beam
from apache_beam.io.kafka import ReadFromKafka
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import trigger
from apache_beam.transforms import window

WINDOW_SECS = 2


def parse(record) -> tuple[str, int]:
  """The per-record Python work: a ``producer-N`` value's number."""
  _, value = record
  prefix, number = value.decode('utf-8').rsplit('-', 1)
  int(number)
  return prefix, 1


def touch_once(out: str, name: str) -> None:
  """An empty file ``name`` in ``out``, written through a temporary name
  and a rename, once (a retried bundle writes nothing new)."""
  final = os.path.join(out, name)
  if not os.path.exists(final):
    temp = os.path.join(out, f'.{name}.{os.getpid()}')
    with open(temp, 'w', encoding='utf-8'):
      pass
    os.replace(temp, final)


class WriteCount(beam.DoFn):
  def __init__(self, out: str):
    self.out = out

  def process(self, element, w=beam.DoFn.WindowParam):
    _, count = element
    name = f'{int(w.start.micros // 1000)}-{count}'
    touch_once(self.out, name)
    yield name


def build(p, bootstrap: str, topic: str, expansion_service: str,
          out: str, poll_secs: int = 2):
  _ = (
      p
      | 'Read' >> ReadFromKafka(
          consumer_config={
              'bootstrap.servers': bootstrap,
              'auto.offset.reset': 'earliest',
          },
          topics=[topic],
          timestamp_policy=ReadFromKafka.log_append_time,
          consumer_polling_timeout=1,
          dynamic_read_poll_interval_seconds=poll_secs,
          expansion_service=expansion_service)
      | 'Parse' >> beam.Map(parse)
      | 'Window' >> beam.WindowInto(
          window.FixedWindows(WINDOW_SECS),
          trigger=trigger.AfterWatermark(late=trigger.AfterCount(1)),
          accumulation_mode=trigger.AccumulationMode.ACCUMULATING,
          allowed_lateness=3600)
      | 'Count' >> beam.CombinePerKey(sum)
      | 'Sink' >> beam.ParDo(WriteCount(out)))


def read_counts(out: str) -> dict[int, list[int]]:
  """Window start (ms) -> the counts its panes wrote, ascending."""
  counts: dict[int, list[int]] = {}
  for name in os.listdir(out):
    if name.startswith('.'):
      continue
    start, count = name.split('-')
    counts.setdefault(int(start), []).append(int(count))
  return {k: sorted(v) for k, v in sorted(counts.items())}


class WriteOnce(beam.DoFn):
  """An idempotent sink: each element an empty file named by it, written
  through a temporary name and a rename."""
  def __init__(self, out: str):
    self.out = out

  def process(self, name):
    touch_once(self.out, name)
    yield name


def build_seeded(p, bootstrap: str, topic: str, count: int,
                 expansion_service: str, out: str):
  """test_xlang_kafka.py's job under load: the first ``count`` records of
  ``topic`` (a bounded read) -> each record, and each key's count (a
  grouping, fired as the read ends) -> one file each."""
  records = (
      p
      | 'Read' >> ReadFromKafka(
          consumer_config={
              'bootstrap.servers': bootstrap,
              'auto.offset.reset': 'earliest',
          },
          topics=[topic], max_num_records=count,
          expansion_service=expansion_service)
      | 'Decode' >> beam.Map(lambda kv: (kv[0].decode(), kv[1].decode())))
  counts = (records | 'Keys' >> beam.Map(lambda kv: (kv[0], 1))
            | 'Count' >> beam.CombinePerKey(sum)
            | 'Name' >> beam.MapTuple(lambda k, n: f'count-{k}-{n}'))
  _ = ((records | 'Record' >> beam.MapTuple(lambda k, v: f'record-{k}-{v}'),
        counts) | beam.Flatten() | 'Sink' >> beam.ParDo(WriteOnce(out)))


def main(argv):
  """python kafka_stream_job.py OUT BOOTSTRAP TOPIC COUNT EXPANSION_SERVICE
  [PIPELINE OPTIONS...]: build_seeded with the in-process runner."""
  out, bootstrap, topic, count, service = argv[1:6]
  logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
  with beam.Pipeline('beam_pyspark.PySparkRunner',
                     options=PipelineOptions(argv[6:])) as p:
    build_seeded(p, bootstrap, topic, int(count), service, out)


def read_names(out: str) -> list[str]:
  return sorted(n for n in os.listdir(out) if not n.startswith('.'))


if __name__ == '__main__':
  main(sys.argv)
