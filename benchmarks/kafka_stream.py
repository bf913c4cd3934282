"""Kafka -> parse -> 1 s fixed windows -> count -> Kafka, at rising offered
rates: Beam's Java KafkaIO on our runner against hand-written PySpark
Structured Streaming with Spark's own Kafka source and sink.

    make bench-kafka-jars   # Spark's Kafka connector, benchmark only
    python -m benchmarks.kafka_stream [--rates 200,1000,3000]
        [--seconds 30] [--variants beam,spark]

A real Kafka broker (beam_pyspark/local/kafka.py) holds, per variant, an input
topic (2 partitions) and an output topic, both stamped with the broker's
LogAppendTime. Kafka's console producer writes ``{"i": n, "k": "kN"}``
records to the input at each offered rate in turn for ``seconds``, in one
job per variant (its start-up paid once, behind a warm-up at 20/s until
its output is within 10 s of the present). Both variants do the same Python
work per record (``json.loads`` of the value), count per 1 s window of
the records' LogAppendTime and write ``window start ms -> count`` to the
output topic:

* beam: ``ReadFromKafka`` (log_append_time) -> ``beam.Map(parse)`` ->
  ``FixedWindows(1)`` -> ``CombineGlobally(count)`` -> ``WriteToKafka``,
  on PySparkRunner ``--streaming`` (local[2]; the Kafka read and write run
  on Beam's Java harness, the parse and count in Python);
* spark: ``readStream.format('kafka')`` -> a Python UDF doing the parse ->
  ``withWatermark(1 s)`` -> ``groupBy(window(timestamp, '1 second'))
  .count()`` -> ``writeStream.format('kafka')`` in append mode (local[2]).

Per rate, over the whole windows of its phase: records/s counted, whether
every window's count equals what the broker holds for it (kept up and
exact), latency p50/p99 (a count's LogAppendTime in the output topic minus
its window's end: the earliest any engine could emit it), and CPU seconds
per million records (user+system of the job's process tree: driver, JVM,
Python workers, Java harnesses, sampled at the phase's bounds).
Machine load skews absolute numbers: read the two variants side by side.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'tests'))

SPARK_KAFKA_CLASSPATH = os.path.join(
    ROOT, 'sdks', 'xlang', 'spark-kafka', 'target', 'classpath.txt')

_BEAM_CHILD = r'''
import json, sys
import apache_beam as beam
from apache_beam.io.kafka import ReadFromKafka, WriteToKafka
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import combiners, window

bootstrap, topic_in, topic_out, service, ckpt = sys.argv[1:6]

def parse(kv):
  return json.loads(kv[1])['i']

def encode(count, w=beam.DoFn.WindowParam):
  return (str(w.start.micros // 1000).encode(), str(count).encode())

p = beam.Pipeline(options=PipelineOptions([
    '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
    '--streaming', '--checkpoint_location=' + ckpt]))
_ = (p
     | ReadFromKafka(consumer_config={'bootstrap.servers': bootstrap,
                                      'auto.offset.reset': 'earliest'},
                     topics=[topic_in], expansion_service=service,
                     timestamp_policy=ReadFromKafka.log_append_time)
     | 'Parse' >> beam.Map(parse)
     | beam.WindowInto(window.FixedWindows(1))
     | combiners.Count.Globally().without_defaults()
     | 'Encode' >> beam.Map(encode).with_output_types(tuple[bytes, bytes])
     | WriteToKafka(producer_config={'bootstrap.servers': bootstrap},
                    topic=topic_out, expansion_service=service))
p.run().wait_until_finish()
'''

_SPARK_CHILD = r'''
import json, sys
from pyspark.sql import SparkSession, functions as F

bootstrap, topic_in, topic_out, jars, ckpt = sys.argv[1:6]
spark = (SparkSession.builder.master('local[2]')
         .config('spark.jars', jars)
         .config('spark.sql.shuffle.partitions', '2')
         .config('spark.ui.enabled', 'false').getOrCreate())

@F.udf('long')
def parse(value):
  return json.loads(value)['i']

records = (spark.readStream.format('kafka')
           .option('kafka.bootstrap.servers', bootstrap)
           .option('subscribe', topic_in)
           .option('startingOffsets', 'earliest').load())
counts = (records
          .select('timestamp', parse(F.col('value').cast('string')).alias('i'))
          .withWatermark('timestamp', '1 second')
          .groupBy(F.window('timestamp', '1 second')).count())
out = counts.select(
    F.unix_millis(F.col('window.start')).cast('string').alias('key'),
    F.col('count').cast('string').alias('value'))
(out.writeStream.format('kafka')
 .option('kafka.bootstrap.servers', bootstrap).option('topic', topic_out)
 .option('checkpointLocation', ckpt).outputMode('append')
 .start().awaitTermination())
'''


def tree_cpu(pid: int) -> float:
  """User+system CPU seconds of ``pid`` and its live descendants (and what
  they reaped)."""
  parents: dict[int, int] = {}
  times: dict[int, float] = {}
  tick = os.sysconf('SC_CLK_TCK')
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/stat', encoding='utf-8') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    except OSError:
      continue
    parents[int(name)] = int(fields[1])
    # utime stime cutime cstime
    times[int(name)] = sum(int(x) for x in fields[11:15]) / tick
  tree, frontier = {pid}, [pid]
  while frontier:
    parent = frontier.pop()
    for child, p in parents.items():
      if p == parent and child not in tree:
        tree.add(child)
        frontier.append(child)
  return sum(times.get(p, 0.0) for p in tree)


class Producer:
  """Kafka's console producer fed ``rate`` records a second."""
  def __init__(self, broker, topic: str):
    self.process = broker.producer(topic)
    self.rate = 0.0
    self.sent = 0
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def set_rate(self, rate: float) -> None:
    with self._lock:
      self._base, self._since, self.rate = self.sent, time.monotonic(), rate

  def _run(self):
    self._base, self._since = 0, time.monotonic()
    while not self._stop.is_set():
      with self._lock:
        due = self._base + int((time.monotonic() - self._since) * self.rate)
      if due > self.sent:
        self.process.stdin.write(''.join(
            f'k{i % 8}\t{{"i": {i}, "k": "k{i % 8}"}}\n'
            for i in range(self.sent, due)).encode())
        self.process.stdin.flush()
        self.sent = due
      self._stop.wait(0.02)

  def stop(self) -> int:
    self._stop.set()
    self._thread.join()
    self.process.stdin.close()
    self.process.wait(120)
    return self.sent


class OutputReader:
  """The output topic as Kafka's console consumer prints it, live:
  (append time ms, window start ms, count)."""
  def __init__(self, broker, topic: str, path: str):
    from beam_pyspark.local.processes import java
    self.path = path
    self._file = open(path, 'wb')
    self.process = subprocess.Popen(
        [java(), '-Xmx256m', '-XX:+UseSerialGC', '-cp', broker.classpath,
         'org.apache.kafka.tools.consumer.ConsoleConsumer',
         '--bootstrap-server', broker.bootstrap, '--topic', topic,
         '--from-beginning', '--property', 'print.timestamp=true',
         '--property', 'print.key=true'],
        stdout=self._file, stderr=subprocess.DEVNULL, start_new_session=True)

  def rows(self) -> list[tuple[int, int, int]]:
    rows = []
    with open(self.path, encoding='utf-8', errors='replace') as f:
      for line in f:
        parts = line.rstrip('\n').split('\t')
        if len(parts) == 3 and ':' in parts[0]:
          try:
            rows.append((int(parts[0].split(':', 1)[1]), int(parts[1]),
                         int(parts[2])))
          except ValueError:
            pass
    return rows

  def stop(self) -> None:
    self.process.terminate()
    self.process.wait(30)
    self._file.close()


def _quantile(values: list[float], q: float) -> float:
  values = sorted(values)
  return values[min(len(values) - 1, int(q * len(values)))]


def run_variant(variant: str, broker, service, rates: list[float],
                seconds: float, tmp: str) -> list[dict]:
  topic_in, topic_out = f'in-{variant}', f'out-{variant}'
  broker.create_topic(topic_in, 2, message_timestamp_type='LogAppendTime')
  broker.create_topic(topic_out, 1, message_timestamp_type='LogAppendTime')
  ckpt = os.path.join(tmp, f'ckpt-{variant}')
  if variant == 'beam':
    args = [sys.executable, '-c', _BEAM_CHILD, broker.bootstrap, topic_in,
            topic_out, service.address, ckpt]
  else:
    with open(SPARK_KAFKA_CLASSPATH, encoding='utf-8') as f:
      jars = ','.join(f.read().strip().split(':'))
    args = [sys.executable, '-c', _SPARK_CHILD, broker.bootstrap, topic_in,
            topic_out, jars, ckpt]
  log = open(os.path.join(tmp, f'{variant}.log'), 'wb')
  child = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
  reader = OutputReader(broker, topic_out, os.path.join(tmp, f'{variant}.out'))
  producer = Producer(broker, topic_in)
  phases = []
  try:
    producer.set_rate(20)
    started = time.monotonic()
    while not reader.rows():
      if child.poll() is not None or time.monotonic() - started > 900:
        raise RuntimeError(f'{variant} never wrote a window; see {log.name}')
      time.sleep(1)
    print(f'{variant}: first window after {time.monotonic() - started:.0f} s',
          flush=True)
    # Then the warm-up's backlog: until a window of the last 10 s is out.
    caught_up = time.monotonic() + 300
    while (max(start for _, start, _ in reader.rows()) <
           (time.time() - 10) * 1000 and time.monotonic() < caught_up):
      time.sleep(1)
    print(f'{variant}: caught up after {time.monotonic() - started:.0f} s',
          flush=True)
    for rate in rates:
      cpu0, sent0, t0 = tree_cpu(child.pid), producer.sent, time.time()
      producer.set_rate(rate)
      time.sleep(seconds)
      phases.append({'rate': rate, 'from_ms': int(t0 * 1000),
                     'to_ms': int(time.time() * 1000),
                     'cpu': tree_cpu(child.pid) - cpu0,
                     'sent': producer.sent - sent0})
    producer.set_rate(0)
    # The last windows close once the watermark passes them: a trickle.
    producer.set_rate(5)
    time.sleep(min(60, seconds))
  finally:
    produced = producer.stop()
    os.killpg(child.pid, 15)
    child.wait(60)
    reader.stop()
    log.close()
  stored = broker.timestamps(topic_in, produced, timeout_ms=30000)
  expected = collections.Counter(ms - ms % 1000 for _, ms in stored)
  out = reader.rows()
  results = []
  for phase in phases:
    windows = [w for w in expected
               if phase['from_ms'] + 1000 <= w and w + 1000 <= phase['to_ms']]
    emitted = {}
    for at, start, count in out:
      if start in windows and start not in emitted:
        emitted[start] = (at, count)
    latencies = [(at - (w + 1000)) / 1000 for w, (at, _) in emitted.items()]
    counted = sum(c for _, c in emitted.values())
    span = len(windows) or 1
    results.append({
        'variant': variant, 'rate': phase['rate'],
        'records_per_sec': counted / span,
        'exact': len(emitted) == len(windows) and all(
            emitted[w][1] == expected[w] for w in windows),
        'latency_p50': _quantile(latencies, 0.5) if latencies else None,
        'latency_p99': _quantile(latencies, 0.99) if latencies else None,
        'cpu_per_million': phase['cpu'] / max(1, phase['sent']) * 1e6,
    })
    print(json.dumps(results[-1]), flush=True)
  return results


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rates', default='200,1000,3000')
  parser.add_argument('--seconds', type=float, default=30)
  parser.add_argument('--variants', default='beam,spark')
  args = parser.parse_args(argv)
  from beam_pyspark.local.kafka import KafkaBroker
  from beam_pyspark.local.expansion import ExpansionService
  if 'spark' in args.variants and not os.path.exists(SPARK_KAFKA_CLASSPATH):
    sys.exit('Spark\'s Kafka connector is missing: run make bench-kafka-jars')
  rates = [float(r) for r in args.rates.split(',')]
  tmp = tempfile.mkdtemp(prefix='beam-pyspark-kafka-bench-')
  print(f'logs in {tmp}', flush=True)
  broker = KafkaBroker(os.path.join(tmp, 'kafka'))
  service = None
  results = []
  try:
    if 'beam' in args.variants:
      os.makedirs(os.path.join(tmp, 'xkafka'))
      service = ExpansionService('kafka', os.path.join(tmp, 'xkafka'))
    for variant in args.variants.split(','):
      results += run_variant(variant, broker, service, rates, args.seconds,
                             tmp)
  finally:
    if service is not None:
      service.stop()
    broker.stop()
  print()
  print('| offered/s | variant | records/s | exact | latency p50 (s) | '
        'latency p99 (s) | CPU s / M records |')
  print('|---|---|---|---|---|---|---|')
  for r in sorted(results, key=lambda r: (r['rate'], r['variant'])):
    p50 = '-' if r['latency_p50'] is None else f'{r["latency_p50"]:.2f}'
    p99 = '-' if r['latency_p99'] is None else f'{r["latency_p99"]:.2f}'
    print(f'| {r["rate"]:.0f} | {r["variant"]} | {r["records_per_sec"]:.0f} '
          f'| {"yes" if r["exact"] else "no"} | {p50} | {p99} | '
          f'{r["cpu_per_million"]:.0f} |')


if __name__ == '__main__':
  main()
