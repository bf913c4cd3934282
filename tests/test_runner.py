"""PipelineResult behaviour: state, cancel, metrics, options."""

import time

import apache_beam as beam
import pytest
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.runner import PipelineState

from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.options import RunnerOptions

OURS = ['--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]']


def _slow(x):
  time.sleep(60)
  return x


def test_cancel_stops_the_spark_work():
  from pyspark import SparkContext
  p = beam.Pipeline(options=PipelineOptions(OURS))
  _ = p | beam.Create(list(range(4))) | beam.Map(_slow)
  result = p.run()
  deadline = time.monotonic() + 120
  sc = None
  while time.monotonic() < deadline:
    sc = SparkContext._active_spark_context
    if (result.state == PipelineState.RUNNING and sc is not None and
        sc.statusTracker().getActiveJobsIds()):
      break
    time.sleep(0.2)
  assert sc is not None and sc.statusTracker().getActiveJobsIds()
  started = time.monotonic()
  assert result.cancel() == PipelineState.CANCELLED
  assert result.state == PipelineState.CANCELLED
  assert time.monotonic() - started < 30
  deadline = time.monotonic() + 30
  while sc.statusTracker().getActiveJobsIds() and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not sc.statusTracker().getActiveJobsIds()


class _Counting(beam.DoFn):
  def process(self, x):
    Metrics.counter('test', 'elements').inc()
    Metrics.distribution('test', 'values').update(x)
    yield x


def test_state_and_metrics_after_success():
  p = beam.Pipeline(options=PipelineOptions(OURS))
  _ = p | beam.Create(list(range(1, 101))) | beam.ParDo(_Counting())
  result = p.run()
  # 0 is no limit, as Beam's PortableRunner reads it (its load tests).
  assert result.wait_until_finish(duration=0) == PipelineState.DONE
  assert result.wait_until_finish() == PipelineState.DONE
  assert result.state == PipelineState.DONE
  counters = result.metrics().query(
      MetricsFilter().with_name('elements'))['counters']
  assert [c.committed for c in counters] == [100]
  (dist,) = result.metrics().query(
      MetricsFilter().with_name('values'))['distributions']
  assert (dist.committed.count, dist.committed.sum, dist.committed.min,
          dist.committed.max) == (100, 5050, 1, 100)


def test_unsupported_pipeline_is_refused_before_running():
  from apache_beam.testing.test_stream import TestStream
  p = beam.Pipeline(options=PipelineOptions(OURS))
  # Beam's runners replay one TestStream; two are refused.
  _ = p | 'One' >> TestStream().add_elements([1]) | beam.Map(str)
  _ = p | 'Two' >> TestStream().add_elements([2]) | 'Str' >> beam.Map(str)
  with pytest.raises(UnsupportedPipelineError, match='TestStream'):
    p.run()


def test_spark_options():
  settings = RunnerOptions.from_pipeline_options(PipelineOptions([
      '--spark_master_url=local[3]', '--spark_conf', 'spark.a=1',
      '--spark_conf=spark.b=x=y'
  ]))
  assert settings.master == 'local[3]'
  assert settings.conf == {'spark.a': '1', 'spark.b': 'x=y'}
  # Beam's default master is not forced on a user's running Spark.
  assert RunnerOptions.from_pipeline_options(PipelineOptions([])).master is None


def test_executor_logs_reach_the_client_log(client_log):
  import logging

  def chatty(x):
    import logging as lg
    lg.getLogger('my.runner.dofn').warning('hello from %s', x)
    return x

  with beam.Pipeline(options=PipelineOptions(OURS)) as p:
    _ = p | beam.Create(['w1', 'w2']) | beam.Map(chatty)
  assert (logging.WARNING, 'my.runner.dofn: hello from w1') in client_log.seen
  assert (logging.WARNING, 'my.runner.dofn: hello from w2') in client_log.seen
