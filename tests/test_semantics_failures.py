"""Failures on local[2]: a user error fails the pipeline with its traceback;
an unsupported pipeline is refused before anything runs."""

import os

import pytest

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pvalue import AsSingleton
from apache_beam.runners.runner import PipelineState
from apache_beam.testing import test_stream
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import TimerSpec
from apache_beam.transforms.userstate import on_timer
from apache_beam.utils.timestamp import Timestamp

from beam_pyspark.errors import UnsupportedPipelineError


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


def explode_on_purpose(x):
  if x == 7:
    raise ValueError('element seven is cursed')
  return x


class ExplodingAfterGroup(beam.DoFn):
  def process(self, kv):
    key, values = kv
    if key == 'bad':
      raise_from_helper_function(len(list(values)))
    yield key


def raise_from_helper_function(n):
  raise RuntimeError(f'bad key had {n} values')


class ExplodingTimer(beam.DoFn):
  TIMER = TimerSpec('timer', TimeDomain.WATERMARK)

  def process(self, kv, timer=beam.DoFn.TimerParam(TIMER)):
    timer.set(Timestamp(5))

  @on_timer(TIMER)
  def explode_in_timer_callback(self, key=beam.DoFn.KeyParam):
    raise KeyError(f'timer exploded for key {key}')
    yield  # pylint: disable=unreachable


class TouchFile(beam.DoFn):
  def __init__(self, path):
    self.path = path

  def process(self, x):
    with open(self.path, 'a') as f:
      f.write(f'{x}\n')
    yield x


def test_failing_dofn_fails_the_pipeline_with_user_traceback():
  p = beam.Pipeline(options=options())
  _ = (
      p | beam.Create(range(20))
      | beam.Reshuffle()
      | beam.Map(explode_on_purpose))
  result = p.run()
  with pytest.raises(Exception) as raised:
    result.wait_until_finish()
  message = str(raised.value)
  assert 'element seven is cursed' in message
  assert 'explode_on_purpose' in message
  assert 'ValueError' in message
  assert result.state == PipelineState.FAILED


def test_failure_after_group_by_key_names_the_user_functions():
  p = beam.Pipeline(options=options())
  _ = (
      p | beam.Create([('good', 1), ('bad', 2), ('bad', 3), ('fine', 4)])
      | beam.GroupByKey()
      | beam.ParDo(ExplodingAfterGroup()))
  result = p.run()
  with pytest.raises(Exception) as raised:
    result.wait_until_finish()
  message = str(raised.value)
  assert 'bad key had 2 values' in message
  assert 'raise_from_helper_function' in message
  assert 'test_semantics_failures.py' in message
  assert result.state == PipelineState.FAILED


def test_failure_in_timer_callback_fails_the_pipeline():
  p = beam.Pipeline(options=options())
  _ = (
      p | beam.Create([('a', 1), ('b', 2)])
      | beam.ParDo(ExplodingTimer()))
  result = p.run()
  with pytest.raises(Exception) as raised:
    result.wait_until_finish()
  message = str(raised.value)
  assert 'timer exploded for key' in message
  assert 'explode_in_timer_callback' in message
  assert result.state == PipelineState.FAILED


def test_singleton_side_input_with_two_values_fails():
  p = beam.Pipeline(options=options())
  side = p | 'Side' >> beam.Create([1, 2])
  _ = p | beam.Create([0]) | beam.Map(lambda x, s: s, AsSingleton(side))
  result = p.run()
  with pytest.raises(Exception) as raised:
    result.wait_until_finish()
  assert 'singleton' in str(raised.value)
  assert result.state == PipelineState.FAILED


def test_failure_with_pipeline_context_manager_raises():
  with pytest.raises(Exception) as raised:
    with beam.Pipeline(options=options()) as p:
      _ = p | beam.Create([5, 6, 7]) | beam.Map(explode_on_purpose)
  assert 'element seven is cursed' in str(raised.value)


def test_spark_still_usable_after_a_failed_pipeline():
  p = beam.Pipeline(options=options())
  _ = p | beam.Create([7]) | beam.Map(explode_on_purpose)
  result = p.run()
  with pytest.raises(Exception):
    result.wait_until_finish()
  assert result.state == PipelineState.FAILED
  with beam.Pipeline(options=options()) as p:
    out = p | beam.Create([1, 2, 3]) | beam.Map(explode_on_purpose)
    assert_that(out, equal_to([1, 2, 3]))


def test_failing_assert_that_fails_the_pipeline():
  # Our runner must not pass a wrong assertion: the other tests rely on it.
  with pytest.raises(Exception) as raised:
    with beam.Pipeline(options=options()) as p:
      out = p | beam.Create([1, 2, 3]) | beam.Map(lambda x: x * 10)
      assert_that(out, equal_to([10, 20, 31]))
  assert 'missing elements [31]' in str(raised.value)


def test_two_test_streams_are_refused_before_running(tmp_path):
  # Beam's runners replay one TestStream per pipeline.
  marker = str(tmp_path / 'ran.txt')
  p = beam.Pipeline(options=options())
  _ = (
      p | test_stream.TestStream().add_elements([1, 2, 3]).advance_watermark_to_infinity()
      | 'Double' >> beam.Map(lambda x: x * 2))
  _ = p | 'Again' >> test_stream.TestStream().add_elements([4])
  _ = p | 'Other' >> beam.Create([1, 2]) | beam.ParDo(TouchFile(marker))
  with pytest.raises(UnsupportedPipelineError) as raised:
    p.run()
  assert 'TestStream' in str(raised.value)
  assert any('TestStream' in reason for reason in raised.value.reasons)
  assert not os.path.exists(marker)


def test_every_unsupported_item_is_listed_at_once():
  p = beam.Pipeline(options=options())
  _ = p | 'First' >> test_stream.TestStream().add_elements([1])
  _ = p | 'Second' >> test_stream.TestStream().add_elements(['a'])
  with pytest.raises(UnsupportedPipelineError) as raised:
    p.run()
  # One reason names them all (tests/test_planning.py lists several kinds
  # of reason at once).
  (reason,) = [r for r in raised.value.reasons if 'TestStream' in r]
  assert 'First' in reason and 'Second' in reason
