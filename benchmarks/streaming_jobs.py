"""The jobs benchmarks/streaming_throughput.py runs, each as a program of
its own in a fresh process (``python PROGRAM.py rate seconds out master
lead [args]``): ours on beam_pyspark, PySpark Structured Streaming, PyFlink
(in its own virtualenv's Python). Each notes its panes in ``out``, a line
``window_end emit_time count`` each, and prints a ``STATS {json}`` line.
"""

OURS = r'''
import json, logging, os, re, sys, time
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


class Batches(logging.Handler):
  # Each micro-batch's job message ("Micro-batch N: S s, ..."), with when
  # it ended: the profile (benchmarks/streaming_profile.py) reads them.
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.seen = []

  def emit(self, record):
    found = re.match(r'Micro-batch (\d+): ([\d.]+) s', record.getMessage())
    if found:
      self.seen.append((record.created, float(found.group(2))))


batches = Batches()
runner_log = logging.getLogger('beam_pyspark.runner')
runner_log.setLevel(logging.DEBUG)
runner_log.propagate = False
runner_log.addHandler(batches)
start = time.time() + lead
p = beam.Pipeline(options=PipelineOptions([
    '--streaming', '--runner=beam_pyspark.PySparkRunner',
    '--spark_master_url=' + master] + sys.argv[6:]))
# An experiment: the events from N sources (each at rate / N, shifted so
# that together they fire every 1 / rate s), flattened. Beam's
# PeriodicImpulse keeps its interval in whole microseconds: one source
# cannot fire faster than 1,000,000 times a second.
sources = int(os.environ.get('BENCH_SOURCES', '1'))
if sources == 1:
  events = p | PeriodicImpulse(
      start_timestamp=start, stop_timestamp=start + seconds,
      fire_interval=1.0 / rate)
else:
  events = [p | f'Source{i}' >> PeriodicImpulse(
      start_timestamp=start + i / rate, stop_timestamp=start + seconds,
      fire_interval=sources / rate) for i in range(sources)] | beam.Flatten()
if os.environ.get('BENCH_RESHUFFLE'):  # an experiment: the read's output moved
  events = events | beam.Reshuffle()
_ = (events
     | beam.Map(lambda t: (int(float(t) * 1000) % 10, 1))
     | beam.WindowInto(window.FixedWindows(1))
     | beam.CombinePerKey(sum)
     | beam.ParDo(Note(out)))
result = p.run()
result.wait_until_finish()
stats = {'start': start, 'micro_batches': batches.seen}
found = result.metrics().query(MetricsFilter().with_name(
    'micro_batch_millis'))['distributions']
if found:
  d = found[0].committed
  stats.update(batches=d.count, batch_min_ms=d.min, batch_mean_ms=d.mean,
               batch_max_ms=d.max)
print('STATS ' + json.dumps(stats))
'''

PYSPARK = r'''
import json, os, sys, time
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

rate, seconds, out, master, lead, udf_kind = sys.argv[1:7]
rate, seconds = int(float(rate)), float(seconds)
builder = (SparkSession.builder.master(master)
           .config('spark.sql.shuffle.partitions', '2')
           .config('spark.ui.enabled', 'false')
           .config('spark.ui.showConsoleProgress', 'false'))
if udf_kind == 'pickled':
  # The UDF as PySpark ran it before 4.x's default: rows pickled to the
  # Python worker in batches (BatchEvalPython), not Arrow record batches.
  builder = builder.config('spark.sql.execution.pythonUDF.arrow.enabled',
                           'false')
spark = builder.getOrCreate()
ARROW = 'spark.sql.execution.pythonUDF.arrow.enabled'


def worker_info(_):
  # Evaluated in a Python worker: which interpreter Spark started and
  # whether it has pyarrow (an Arrow UDF fails without it).
  import importlib.util
  import sys as worker_sys
  arrow = importlib.util.find_spec('pyarrow')
  if arrow is not None:
    import pyarrow
    return worker_sys.executable + ' pyarrow ' + pyarrow.__version__
  return worker_sys.executable + ' no pyarrow'


worker = spark.range(1).select(F.udf(worker_info, 'string')('id')).first()[0]
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
# The last micro-batch's physical plan names how the key UDF ran:
# ArrowEvalPython (Arrow record batches) or BatchEvalPython (pickled rows).
plan = query._jsq.explainInternal(False) if query.isActive else ''
evals = sorted({n for n in ('ArrowEvalPython', 'BatchEvalPython')
                if n in plan})
time.sleep(seconds)
if query.exception() is not None:
  raise SystemExit(str(query.exception()))
query.stop()
print('STATS ' + json.dumps({
    'start': started, 'udf_eval': '+'.join(evals) or 'unknown',
    'arrow_enabled': spark.conf.get(ARROW), 'worker': worker}))
'''

PYFLINK = r'''
import json, os, sys, time
from datetime import timezone
from pyflink.common import Configuration
from pyflink.datastream import StreamExecutionEnvironment
from pyflink.table import DataTypes, StreamTableEnvironment
from pyflink.table.udf import udf

rate, seconds, out, master, lead = sys.argv[1:6]
rate, seconds = int(float(rate)), float(seconds)
env = StreamExecutionEnvironment.get_execution_environment()
# Its defaults: the local mini-cluster's parallelism is the machine's
# cores; Python UDFs in bundles of Flink's default size and time. The time
# zone only makes the window ends printed below UTC, as the others'.
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
print('STATS ' + json.dumps({'start': started,
                             'parallelism': env.get_parallelism()}))
'''
