"""Pipelines run once on each engine, to compare (tests/test_connect.py).

Not a test module: ``python connect_jobs.py OUT_DIR [RUNNER FLAGS...]``
runs Beam's WordCount and a pipeline of GroupByKey, lifted and unlifted
combines, side inputs (singleton, list, dict), Flatten, a stateful DoFn,
Reshuffle and a user counter, and the DataFrame example of the README and docs/guide/running.md, and
writes what each produced (sorted
lines) and the counter's committed value to OUT_DIR/results.json. With
``--streaming`` among the flags it instead submits a streaming pipeline
and writes the error it got.
"""

import glob
import json
import os
import sys

import apache_beam as beam
from apache_beam.examples import wordcount
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import userstate

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(os.path.dirname(HERE), 'examples', 'data', 'sample.txt')


class CountPerKey(beam.DoFn):
  """A stateful DoFn: each key's running count, emitted per element."""
  COUNT = userstate.CombiningValueStateSpec('count', sum)

  def process(self, element, count=beam.DoFn.StateParam(COUNT)):
    count.add(1)
    yield element[0], count.read()


class Scale(beam.DoFn):
  def __init__(self):
    self.seen = Metrics.counter('connect_jobs', 'scaled')

  def process(self, element, factor, offsets):
    self.seen.inc()
    key, value = element
    yield key, value * factor + offsets.get(key, 0)


def lines(path_prefix: str) -> list[str]:
  out = []
  for path in sorted(glob.glob(path_prefix + '*')):
    with open(path, encoding='utf-8') as f:
      out.extend(line.rstrip('\n') for line in f)
  return sorted(out)


def mixed(out: str, flags: list[str]) -> int:
  options = PipelineOptions(['--runner=beam_pyspark.PySparkRunner'] + flags)
  p = beam.Pipeline(options=options)
  numbers = p | 'numbers' >> beam.Create(range(2000))
  pairs = numbers | 'pairs' >> beam.Map(lambda n: (f'k{n % 13}', n))
  factor = p | 'factor' >> beam.Create([3])
  offsets = p | 'offsets' >> beam.Create([('k1', 1000), ('k2', 2000)])
  scaled = pairs | 'scale' >> beam.ParDo(
      Scale(), beam.pvalue.AsSingleton(factor), beam.pvalue.AsDict(offsets))
  grouped = (scaled | 'gbk' >> beam.GroupByKey()
             | 'sum groups' >> beam.MapTuple(lambda k, vs: (k, sum(vs))))
  lifted = scaled | 'combine' >> beam.CombinePerKey(sum)
  extra = p | 'extra' >> beam.Create([('k1', 7), ('k99', 1)])
  flat = (scaled, extra) | 'flatten' >> beam.Flatten()
  counted = (flat | 'reshuffle' >> beam.Reshuffle()
             | 'per key' >> beam.ParDo(CountPerKey())
             | 'max' >> beam.CombinePerKey(max))
  everything = p | 'all' >> beam.Create(['a', 'b', 'c'])
  listed = everything | 'with list' >> beam.Map(
      lambda x, l: f'{x}:{len(l)}', beam.pvalue.AsList(numbers))
  for name, pcoll in (('grouped', grouped), ('lifted', lifted),
                      ('counted', counted), ('listed', listed)):
    _ = pcoll | f'write {name}' >> beam.io.WriteToText(
        os.path.join(out, name))
  result = p.run()
  result.wait_until_finish()
  counters = result.metrics().query(
      MetricsFilter().with_name('scaled'))['counters']
  return sum(c.committed for c in counters)


def dataframe(out: str, flags: list[str]) -> list[str]:
  """The DataFrame example (README, docs/guide/running.md) over a CSV of its own."""
  from apache_beam.dataframe.io import read_csv
  sales = os.path.join(out, 'sales.csv')
  with open(sales, 'w', encoding='utf-8') as f:
    f.write('region,amount\n')
    for i in range(300):
      f.write(f'r{i % 4},{i}\n')
  with beam.Pipeline(options=PipelineOptions(
      ['--runner=beam_pyspark.PySparkRunner'] + flags)) as p:
    rows = p | read_csv(sales)
    rows.groupby('region').amount.sum().to_csv(os.path.join(out, 'totals'))
  return lines(os.path.join(out, 'totals'))


def cancelled(flags: list[str]) -> dict:
  """A job whose one task sleeps for ten minutes, cancelled once it runs:
  its state, and how long the cancel took to end it."""
  import time
  options = PipelineOptions(['--runner=beam_pyspark.PySparkRunner'] + flags)
  p = beam.Pipeline(options=options)
  _ = p | beam.Create([1]) | beam.Map(lambda x: time.sleep(600))
  result = p.run()
  deadline = time.monotonic() + 120
  while result.state != 'RUNNING' and time.monotonic() < deadline:
    time.sleep(0.2)
  time.sleep(3)
  started = time.monotonic()
  result.cancel()
  state = result.wait_until_finish()
  return {'state': str(state), 'secs': time.monotonic() - started}


def streaming(flags: list[str]) -> str:
  options = PipelineOptions(
      ['--runner=beam_pyspark.PySparkRunner', '--streaming'] + flags)
  try:
    with beam.Pipeline(options=options) as p:
      _ = p | beam.Create([1]) | beam.Map(print)
  except Exception as exn:  # pylint: disable=broad-except
    return f'{type(exn).__name__}: {exn}'
  return 'ran'


def main(argv: list[str]) -> None:
  out, flags = argv[0], [f for f in argv[1:] if f != '--cancel']
  results = {}
  if '--streaming' in flags:
    results['streaming'] = streaming(
        [f for f in flags if f != '--streaming'])
  else:
    wordcount.run(['--runner=beam_pyspark.PySparkRunner', '--input', SAMPLE,
                   '--output', os.path.join(out, 'counts')] + flags,
                  save_main_session=False)
    results['wordcount'] = lines(os.path.join(out, 'counts'))
    results['scaled'] = mixed(out, flags)
    for name in ('grouped', 'lifted', 'counted', 'listed'):
      results[name] = lines(os.path.join(out, name))
    results['dataframe'] = dataframe(out, flags)
    if '--cancel' in argv:
      results['cancelled'] = cancelled(flags)
    remote = [f.split('=', 1)[1] for f in flags
              if f.startswith('--spark_remote=')]
    if remote:
      # The session's Arrow settings after the jobs (the engine sets its
      # own while they run).
      from pyspark.sql.connect.session import SparkSession
      from beam_pyspark.connect.engine import SESSION_CONF
      conf = SparkSession.builder.remote(remote[0]).getOrCreate().conf
      results['session_conf'] = {name: conf.get(name) for name in SESSION_CONF}
    from pyspark.util import is_remote_only
    results['remote_only'] = is_remote_only()
    # Which PySpark distribution the program imported, and its version.
    import pyspark
    results['pyspark'] = (
        'pyspark-client' if is_remote_only() else 'pyspark',
        pyspark.__version__)
    results['jvm_modules'] = sorted(
        m for m in sys.modules if m == 'py4j' or m.startswith(
            ('py4j.', 'pyspark.core')))
  with open(os.path.join(out, 'results.json'), 'w', encoding='utf-8') as f:
    json.dump(results, f)


if __name__ == '__main__':
  import logging
  # (force: importing Beam already gave the root logger a WARNING handler.)
  logging.basicConfig(level=logging.INFO, force=True)
  main(sys.argv[1:])
