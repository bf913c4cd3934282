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
"""

from __future__ import annotations

import os

import apache_beam as beam
from apache_beam.io.kafka import ReadFromKafka
from apache_beam.transforms import trigger
from apache_beam.transforms import window

WINDOW_SECS = 2


def parse(record) -> tuple[str, int]:
  """The per-record Python work: a ``producer-N`` value's number."""
  _, value = record
  prefix, number = value.decode('utf-8').rsplit('-', 1)
  int(number)
  return prefix, 1


class WriteCount(beam.DoFn):
  def __init__(self, out: str):
    self.out = out

  def process(self, element, w=beam.DoFn.WindowParam):
    _, count = element
    name = f'{int(w.start.micros // 1000)}-{count}'
    final = os.path.join(self.out, name)
    if not os.path.exists(final):
      temp = os.path.join(self.out, f'.{name}.{os.getpid()}')
      with open(temp, 'w', encoding='utf-8'):
        pass
      os.replace(temp, final)
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
