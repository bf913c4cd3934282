"""Streaming throughput: this runner against hand-written PySpark Structured
Streaming and PyFlink, the same windowed count at rising offered rates.

    python -m benchmarks.streaming_throughput [--rates 1000,10000,50000]
        [--seconds 45] [--warmup 15] [--variants ours,pyspark,pyflink]
        [--flink-python /tmp/flinkvenv/bin/python] [--repeats 1]

The work, in all three: events at a steady offered rate, a Python function
mapping each event to one of 10 keys (per event, row by row: Beam's Map,
a PySpark per-row ``udf``, a PyFlink scalar Python UDF), 1-second fixed
(tumbling) windows of event time, a count per key and window, and a sink
that notes each pane's window end and the wall-clock time it got there.
Event time is the time an event was due, so latency = emit time minus
window end (the earliest any of them could emit it).

* ``ours``: Beam's ``PeriodicImpulse`` -> ``Map`` -> ``WindowInto`` ->
  ``CombinePerKey(sum)`` on ``beam_pyspark.PySparkRunner --streaming``
  (local[2]); the events start ``--lead`` seconds after the job does, so
  Spark's start-up is not a backlog.
* ``pyspark``: the ``rate`` source (``rowsPerSecond``, 2 partitions) ->
  per-row Python ``udf`` -> ``groupBy(window(ts, '1 second'), key).count()``
  with a zero-delay watermark, append mode, ``foreachBatch`` sink,
  ``spark.sql.shuffle.partitions=2``, local[2], default trigger.
* ``pyflink``: PyPI ``apache-flink`` (never installed by ``make test``: it
  pins its own Beam, so it lives in its own virtualenv, ``--flink-python``)
  in its local mini-cluster, parallelism 2: the ``datagen`` connector
  (``rows-per-second``, a sequence, ``ts AS LOCALTIMESTAMP`` with
  ``WATERMARK FOR ts AS ts``) -> Python scalar UDF for the key -> a
  tumbling-window count -> a Python UDF noting the pane -> ``blackhole``.

Each (variant, rate) runs in a fresh process; the order of the variants
rotates between rates and repeats (the machine is shared: compare the
systems within one run, not runs across time). Over the windows after
``--warmup`` seconds of events, printed per run: records/s counted, whether
it kept up (every event counted, latency not growing from the first third
of the windows to the last, p50 under 5 s), latency p50/p99, the cores the
whole process tree used (sampled from /proc) and its CPU seconds per
million events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

_OURS = r'''
import json, os, sys, time
import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse

rate, seconds, out, master, lead = sys.argv[1:6]
rate, seconds, lead = float(rate), float(seconds), float(lead)


class Note(beam.DoFn):
  def __init__(self, path):
    self.path = path

  def process(self, kv, w=beam.DoFn.WindowParam):
    line = '%f %f %d\n' % (float(w.end), time.time(), kv[1])
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
      os.write(fd, line.encode())
    finally:
      os.close(fd)


start = time.time() + lead
p = beam.Pipeline(options=PipelineOptions([
    '--streaming', '--runner=beam_pyspark.PySparkRunner',
    '--spark_master_url=' + master] + sys.argv[6:]))
events = p | PeriodicImpulse(
    start_timestamp=start, stop_timestamp=start + seconds,
    fire_interval=1.0 / rate)
if os.environ.get('BENCH_RESHUFFLE'):  # an experiment: the read's output moved
  events = events | beam.Reshuffle()
_ = (events
     | beam.Map(lambda t: (int(float(t) * 1000) % 10, 1))
     | beam.WindowInto(window.FixedWindows(1))
     | beam.CombinePerKey(sum)
     | beam.ParDo(Note(out)))
result = p.run()
result.wait_until_finish()
stats = {'start': start}
found = result.metrics().query(MetricsFilter().with_name(
    'micro_batch_millis'))['distributions']
if found:
  d = found[0].committed
  stats.update(batches=d.count, batch_min_ms=d.min, batch_mean_ms=d.mean)
print('STATS ' + json.dumps(stats))
'''

_PYSPARK = r'''
import json, os, sys, time
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

rate, seconds, out, master, lead = sys.argv[1:6]
rate, seconds = int(float(rate)), float(seconds)
spark = (SparkSession.builder.master(master)
         .config('spark.sql.shuffle.partitions', '2')
         # A per-row (pickled) Python UDF, not an Arrow-batched one.
         .config('spark.sql.execution.pythonUDF.arrow.enabled', 'false')
         .config('spark.ui.enabled', 'false')
         .config('spark.ui.showConsoleProgress', 'false').getOrCreate())
key = F.udf(lambda v: v % 10, 'int')
events = (spark.readStream.format('rate').option('rowsPerSecond', rate)
          .option('numPartitions', 2).load())
counts = (events.withWatermark('timestamp', '0 seconds')
          .groupBy(F.window('timestamp', '1 second'),
                   key('value').alias('k')).count())


def sink(batch, _):
  rows = batch.select(F.col('window.end').cast('double').alias('end'),
                      'count').collect()
  now = time.time()
  if not rows:
    return
  with open(out, 'a', encoding='utf-8') as f:
    for row in rows:
      f.write('%f %f %d\n' % (row['end'], now, row['count']))


ckpt = out + '.ckpt'
query = (counts.writeStream.outputMode('append').foreachBatch(sink)
         .option('checkpointLocation', ckpt).start())
deadline = time.time() + 300  # start-up: until the first pane
while (not os.path.exists(out) and time.time() < deadline and
       query.isActive):
  time.sleep(0.2)
started = time.time()
time.sleep(seconds)
if query.exception() is not None:
  raise SystemExit(str(query.exception()))
query.stop()
print('STATS ' + json.dumps({'start': started}))
'''

_PYFLINK = r'''
import json, os, sys, time
from datetime import timezone
from pyflink.common import Configuration
from pyflink.datastream import StreamExecutionEnvironment
from pyflink.table import DataTypes, StreamTableEnvironment
from pyflink.table.udf import udf

rate, seconds, out, master, lead = sys.argv[1:6]
rate, seconds = int(float(rate)), float(seconds)
env = StreamExecutionEnvironment.get_execution_environment()
env.set_parallelism(2)
t_env = StreamTableEnvironment.create(env)
t_env.get_config().set('table.local-time-zone', 'UTC')
t_env.execute_sql(f"""
  CREATE TABLE events (seq BIGINT, ts AS LOCALTIMESTAMP,
                       WATERMARK FOR ts AS ts)
  WITH ('connector' = 'datagen', 'rows-per-second' = '{rate}',
        'fields.seq.kind' = 'sequence', 'fields.seq.start' = '0',
        'fields.seq.end' = '{int(rate * seconds * 4)}')""")
t_env.execute_sql(
    "CREATE TABLE sink (n INT) WITH ('connector' = 'blackhole')")


@udf(result_type=DataTypes.INT())
def key(v):
  return v % 10


@udf(result_type=DataTypes.INT())
def note(end, count):
  line = '%f %f %d\n' % (end.replace(tzinfo=timezone.utc).timestamp(),
                         time.time(), count)
  fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
  try:
    os.write(fd, line.encode())
  finally:
    os.close(fd)
  return 1


t_env.create_temporary_function('bkey', key)
t_env.create_temporary_function('note', note)
t_env.create_temporary_view('keyed', t_env.sql_query(
    'SELECT bkey(seq) AS k, ts FROM events'))
counted = t_env.sql_query("""
  SELECT window_end, k, COUNT(*) AS c
  FROM TABLE(TUMBLE(TABLE keyed, DESCRIPTOR(ts), INTERVAL '1' SECOND))
  GROUP BY window_start, window_end, k""")
t_env.create_temporary_view('counted', counted)
job = t_env.execute_sql(
    'INSERT INTO sink SELECT note(window_end, CAST(c AS INT)) FROM counted')
deadline = time.time() + 300  # start-up: until the first pane
while not os.path.exists(out) and time.time() < deadline:
  time.sleep(0.2)
started = time.time()
time.sleep(seconds)
job.get_job_client().cancel().result()
print('STATS ' + json.dumps({'start': started}))
'''

_CHILDREN = {'ours': _OURS, 'pyspark': _PYSPARK, 'pyflink': _PYFLINK}


def _tree_cpu(proc: psutil.Process, seen: dict) -> float:
  """CPU seconds so far of ``proc`` and its descendants (``seen`` keeps the
  last reading of each, so processes that ended still count)."""
  try:
    procs = [proc] + proc.children(recursive=True)
  except psutil.Error:
    procs = []
  for p in procs:
    try:
      t = p.cpu_times()
      seen[p.pid] = t.user + t.system + t.children_user + t.children_system
    except psutil.Error:
      pass
  return sum(seen.values())


def run_once(variant: str, rate: float, seconds: float, lead: float,
             master: str, python: str, extra: list) -> dict:
  with tempfile.TemporaryDirectory(prefix='beam-pyspark-tput-') as tmp:
    out = os.path.join(tmp, 'panes')
    cmd = [python, '-c', _CHILDREN[variant], str(rate), str(seconds), out,
           master, str(lead)] + (extra if variant == 'ours' else [])
    log = open(os.path.join(tmp, 'log'), 'w+', encoding='utf-8')
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc, seen, cpu = psutil.Process(child.pid), {}, []
    deadline = time.time() + seconds * 10 + 600
    while child.poll() is None and time.time() < deadline:
      cpu.append((time.time(), _tree_cpu(proc, seen)))
      time.sleep(0.5)
    if child.poll() is None:
      child.kill()
    child.wait()
    log.seek(0)
    text = log.read()
    if child.returncode != 0:
      raise RuntimeError(f'{variant} at {rate}/s failed:\n{text[-3000:]}')
    stats = {}
    for line in text.splitlines():
      if line.startswith('STATS '):
        stats = json.loads(line[6:])
    panes = []
    if os.path.exists(out):
      with open(out, encoding='utf-8') as f:
        panes = [tuple(float(x) for x in line.split()) for line in f]
  stats['panes'] = panes
  stats['cpu'] = cpu
  return stats


# Beyond this median latency a run is behind its offered rate.
LAGGING_SECS = 5.0


def summarize(stats: dict, rate: float, seconds: float, warmup: float,
              variant: str) -> dict:
  panes = stats['panes']
  if not panes:
    return {'error': 'no output'}
  if variant == 'ours':  # the events' span is known
    first, last = stats['start'] + warmup, stats['start'] + seconds
  else:  # from the first pane on (the sources start with the query)
    first = stats['start'] + warmup
    last = stats['start'] + seconds - 3  # the last windows may be cut off
  every = panes
  panes = [(end, at, n) for end, at, n in panes if first < end <= last]
  if not panes:
    return {'error': 'no window ended after the warm-up'}
  latencies = sorted(at - end for end, at, _ in panes)
  ends = sorted({end for end, _, _ in panes})
  counted = sum(n for _, _, n in panes)
  span = ends[-1] - ends[0] + 1
  by_window = {}
  for end, at, _ in panes:
    by_window.setdefault(end, []).append(at - end)
  per_window = [max(by_window[e]) for e in ends]
  third = max(1, len(per_window) // 3)
  growing = (statistics.median(per_window[-third:]) >
             statistics.median(per_window[:third]) + 1.0)
  # The process tree's CPU from its first pane to its last, over the
  # events of the panes that arrived after the first: what it took to
  # count them once started, behind its rate or not.
  arrivals = sorted({at for _, at, _ in every})
  t0, t1 = arrivals[0], arrivals[-1]
  cpu = stats['cpu']
  c0 = _at(cpu, t0)
  c1 = _at(cpu, t1)
  cores = (c1 - c0) / (t1 - t0) if t1 > t0 else float('nan')
  emitted = sum(n for _, at, n in every if t0 < at <= t1)
  summary = {
      'records_per_sec': counted / span,
      'offered_per_sec': rate,
      'kept_up': (counted >= 0.99 * rate * span and not growing and
                  _quantile(latencies, 0.50) <= LAGGING_SECS),
      'latency_p50': _quantile(latencies, 0.50),
      'latency_p99': _quantile(latencies, 0.99),
      'windows': len(ends),
      'cores': cores,
      'cpu_secs_per_million': (c1 - c0) * 1e6 / max(emitted, 1),
  }
  for key in ('batches', 'batch_min_ms', 'batch_mean_ms'):
    if key in stats:
      summary[key] = stats[key]
  return summary


def _at(series: list, t: float) -> float:
  """The series' value at time ``t`` (the last sample before it)."""
  value = series[0][1] if series else 0.0
  for when, v in series:
    if when > t:
      break
    value = v
  return value


def _quantile(values: list[float], q: float) -> float:
  return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rates', default='1000,10000,50000')
  parser.add_argument('--seconds', type=float, default=45)
  parser.add_argument('--warmup', type=float, default=15)
  parser.add_argument('--lead', type=float, default=25,
                      help='ours: seconds from the job start to the events')
  parser.add_argument('--repeats', type=int, default=1)
  parser.add_argument('--variants', default='ours,pyspark,pyflink')
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--flink-python', default='/tmp/flinkvenv/bin/python')
  parser.add_argument('--ours-flag', action='append', default=[],
                      help='an extra pipeline option for ours (repeatable)')
  parser.add_argument('--json', help='Also write the results here.')
  args = parser.parse_args(argv)
  rates = [float(r) for r in args.rates.split(',')]
  variants = args.variants.split(',')
  results, turn = [], 0
  for rate in rates:
    for repeat in range(args.repeats):
      order = variants[turn % len(variants):] + variants[:turn %
                                                         len(variants)]
      turn += 1
      for variant in order:
        python = (args.flink_python if variant == 'pyflink' else
                  sys.executable)
        started = time.monotonic()
        for attempt in range(2):
          try:
            stats = run_once(variant, rate, args.seconds, args.lead,
                             args.master, python, args.ours_flag)
            row = summarize(stats, rate, args.seconds, args.warmup, variant)
          except RuntimeError as exn:
            row = {'error': str(exn)[-400:]}
            # Spark waits 10 s at most for a Python process it starts (its
            # streaming source's): on a loaded machine, once more.
            if 'failed to connect back' in str(exn) and attempt == 0:
              print(f'{variant} at {rate}/s: Spark\'s Python worker did '
                    'not connect back in time; once more', flush=True)
              continue
          break
        if 'error' not in row:  # the raw data, for another summary
          row['raw'] = {k: stats[k] for k in ('start', 'panes', 'cpu')}
        row.update(variant=variant, rate=rate, repeat=repeat,
                   process_secs=time.monotonic() - started,
                   load=os.getloadavg()[0])
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != 'raw'},
                         sort_keys=True), flush=True)
  print()
  print('| offered/s | system | counted/s | kept up | p50 (s) | p99 (s) '
        '| cores | CPU s per M events | load |')
  print('|---|---|---|---|---|---|---|---|---|')
  for r in results:
    if 'error' in r:
      print(f'| {r["rate"]:.0f} | {r["variant"]} | error: '
            f'{r["error"][-80:]!r} ||||||')
      continue
    print(f'| {r["rate"]:.0f} | {r["variant"]} | {r["records_per_sec"]:.0f} '
          f'| {"yes" if r["kept_up"] else "no"} | {r["latency_p50"]:.2f} | '
          f'{r["latency_p99"]:.2f} | {r["cores"]:.2f} | '
          f'{r["cpu_secs_per_million"]:.1f} | {r["load"]:.0f} |')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
