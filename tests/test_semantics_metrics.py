"""User metrics on local[2]: merged over every task of the job.

Counters and distributions add up, gauges keep one reported value, string
sets are unioned; checked by hand and against the FnApiRunner's metrics.
"""

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.runners.runner import PipelineState

NAMESPACE = 'semantics'
N = 1000


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


class Metered(beam.DoFn):
  def __init__(self, prefix=''):
    self.prefix = prefix

  def setup(self):
    p = self.prefix
    self.elements = Metrics.counter(NAMESPACE, p + 'elements')
    self.values = Metrics.distribution(NAMESPACE, p + 'values')
    self.last = Metrics.gauge(NAMESPACE, p + 'last')
    self.parities = Metrics.string_set(NAMESPACE, p + 'parities')

  def process(self, x):
    self.elements.inc()
    self.values.update(x)
    self.last.set(x)
    self.parities.add('even' if x % 2 == 0 else 'odd')
    if x % 100 == 0:
      self.parities.add(f'hundred-{x}')
    yield x


def build(p):
  # Reshuffled: the metered stage runs in several tasks.
  values = (
      p | beam.Create(range(1, N + 1))
      | 'Spread' >> beam.Reshuffle()
      | 'Metered' >> beam.ParDo(Metered()))
  # A second metered step after a GroupByKey, in another stage.
  _ = (
      values | beam.Map(lambda x: (x % 10, x))
      | beam.GroupByKey()
      | beam.MapTuple(lambda k, vs: len(list(vs)))
      | 'MeteredAfterGroup' >> beam.ParDo(Metered('grouped_')))


def run(runner=None, options_=None):
  p = beam.Pipeline(runner=runner, options=options_)
  build(p)
  result = p.run()
  assert result.wait_until_finish() == PipelineState.DONE
  return result


def only(results):
  assert len(results) == 1, results
  return results[0]


def query(result, name, kind):
  return result.metrics().query(
      MetricsFilter().with_namespace(NAMESPACE).with_name(name))[kind]


def test_counter_merged_over_tasks():
  result = run(options_=options())
  counter = only(query(result, 'elements', 'counters'))
  assert counter.committed == N
  assert counter.attempted == N
  assert counter.key.step.endswith('Metered')


def test_distribution_merged_over_tasks():
  result = run(options_=options())
  dist = only(query(result, 'values', 'distributions')).committed
  assert (dist.count, dist.sum, dist.min, dist.max) == (N, N * (N + 1) // 2,
                                                         1, N)


def test_gauge_keeps_a_reported_value():
  result = run(options_=options())
  gauge = only(query(result, 'last', 'gauges')).committed
  assert gauge.value in range(1, N + 1)
  grouped = only(query(result, 'grouped_last', 'gauges')).committed
  assert grouped.value == N // 10


def test_string_set_union_over_tasks():
  result = run(options_=options())
  strings = only(query(result, 'parities', 'string_sets')).committed
  assert set(strings) == {'even', 'odd'} | {
      f'hundred-{x}' for x in range(100, N + 1, 100)}


def test_metrics_of_each_step_are_separate_and_match_fnapi():
  ours = run(options_=options())
  reference = run(runner=FnApiRunner(), options_=PipelineOptions())

  def summary(result):
    metrics = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))
    out = {}
    for r in metrics['counters']:
      out[(r.key.step, r.key.metric.name)] = r.committed
    for r in metrics['distributions']:
      d = r.committed
      out[(r.key.step, r.key.metric.name)] = (d.count, d.sum, d.min, d.max)
    for r in metrics['string_sets']:
      out[(r.key.step, r.key.metric.name)] = sorted(r.committed)
    return out

  ours_summary = summary(ours)
  assert ours_summary == summary(reference)
  grouped = {k: v for k, v in ours_summary.items() if k[1] == 'grouped_elements'}
  assert list(grouped.values()) == [10]
  step_filter = MetricsFilter().with_step('MeteredAfterGroup').with_name(
      'grouped_values')
  dist = only(ours.metrics().query(step_filter)['distributions']).committed
  assert (dist.count, dist.sum, dist.min, dist.max) == (10, N, N // 10,
                                                         N // 10)


def test_metrics_with_more_partitions():
  result = run(options_=options(spark_parallelism=5))
  assert only(query(result, 'elements', 'counters')).committed == N
  dist = only(query(result, 'values', 'distributions')).committed
  assert dist.count == N and dist.sum == N * (N + 1) // 2


def _source_counters(runner, options_):
  from apache_beam.io.iobase import Read
  from apache_beam.io.utils import CountingSource
  p = beam.Pipeline(runner=runner, options=options_)
  _ = p | Read(CountingSource(100)) | beam.Map(lambda x: x)
  result = p.run()
  result.wait_until_finish()
  return sorted(
      (c.key.step, c.key.metric.namespace, c.key.metric.name, c.committed)
      for c in result.metrics().query(MetricsFilter())['counters'])


def test_a_sources_metrics_are_reported_under_beams_step_names():
  # The hardening issue, defect 11: the runner's split read reported them
  # under Read/ReadSplits, where Beam's runners use the SDF reader's step.
  ours = _source_counters(None, options())
  beams = _source_counters(FnApiRunner(), PipelineOptions())
  assert ours == beams
  assert ours and all(step.startswith('Read/SDFBoundedSourceReader/')
                      for step, _, _, _ in ours)
