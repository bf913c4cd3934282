"""A streaming wave's control records reach the driver through an
accumulator (spark.controls) while the keyed outputs' data runs on: each
partition's records once (the last computation's, if Spark computed it
twice), in partition order, and an output no job ran is found."""

from __future__ import annotations

from beam_pyspark.spark.controls import WaveControls
from beam_pyspark.spark.session import spark_context
from beam_pyspark.worker.streaming import HELD_TAG
from beam_pyspark.worker.streaming import REPORT_TAG


def _records(index, _):
  yield ('out', f'data {index}'.encode())
  yield (REPORT_TAG, f'report {index}')
  yield ('out', f'more {index}'.encode())
  if index == 1:
    yield (HELD_TAG, 'held 1')


def test_controls_to_the_driver_data_on():
  sc = spark_context('local[2]')
  controls = WaveControls(sc)
  controls.start()
  base = sc.parallelize([], 3).mapPartitionsWithIndex(_records)
  read = controls.wrap('read', base)
  unread = controls.wrap('unread', sc.parallelize([], 2).mapPartitionsWithIndex(
      _records))
  data = read.collect()
  assert data == [('out', b'data 0'), ('out', b'more 0'), ('out', b'data 1'),
                  ('out', b'more 1'), ('out', b'data 2'), ('out', b'more 2')]
  # Computed again (not persisted): its reports are not doubled.
  assert read.count() == 6
  assert controls.unrun() == [unread]
  unread.collect()
  assert controls.unrun() == []
  taken = controls.take()
  assert taken == [
      ('read', [(REPORT_TAG, 'report 0'), (REPORT_TAG, 'report 1'),
                (HELD_TAG, 'held 1'), (REPORT_TAG, 'report 2')]),
      ('unread', [(REPORT_TAG, 'report 0'), (REPORT_TAG, 'report 1'),
                  (HELD_TAG, 'held 1')]),
  ]
  # The next wave starts empty.
  assert controls.take() == [] and controls.accumulator.value == []
