"""Beam's synthetic records and Beam's load tests written by hand for
PySpark.

``records`` makes the records Beam's ``SyntheticSource`` reads with its
default ('builtin') generator, byte for byte, as its ``read`` does
(``_gen_kv_pair``: the generator seeded with the record's index, a hot key
drawn from a second generator; and ``time.sleep`` of the spec's delay per
record, 0 here, which is a yield of the CPU: on a busy machine it costs
wall and CPU time, in Beam's source and here alike).

The jobs below are Beam's load tests (``apache_beam.testing.load_tests``)
as a PySpark user would write them, each of the tests' ParDos a
``flatMap`` of the same per-element code (their DoFns' ``process``
bodies: ``MeasureTime``'s, ``CounterOperation``'s with Spark accumulators
for Beam's counters, ``AssignTimestamps``' with the timestamp carried in
the value), its GroupByKey ``groupByKey``, its CoGroupByKey ``cogroup``,
its ``TopCombineFn`` ``top``, its dict side input a broadcast dict. This
module imports no Beam: the hand-written jobs' Python workers import it
(docs/benchmarks.md).
"""

from __future__ import annotations

import random
import time
from typing import Iterator


class _Random(random.Random):
  random_sample = random.Random.random


def records(spec: dict, start: int, stop: int) -> Iterator[tuple]:
  """Records ``start`` to ``stop`` of a synthetic source's ``spec`` (the
  load tests' input options: num_records, key_size, value_size,
  hot_key_fraction, num_hot_keys)."""
  key_size = spec.get('key_size', 1)
  size = key_size + spec.get('value_size', 1)
  hot_fraction = spec.get('hot_key_fraction', 0)
  hot_keys = spec.get('num_hot_keys', 0)
  generator = _Random(None)
  sleep = time.sleep
  for index in range(start, stop):
    sleep(0)
    generator.seed(index)
    if generator.random_sample() < hot_fraction:
      hot = _Random(index % hot_keys)
      yield hot.randbytes(key_size), generator.randbytes(size - key_size)
    else:
      data = generator.randbytes(size)
      yield data[:key_size], data[key_size:]


def source(sc, spec: dict):
  """The records as an RDD, in as many partitions as Spark's default
  parallelism (the runner splits a bounded source so)."""
  n = spec['num_records']
  parts = max(1, sc.defaultParallelism)
  ranges = [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
  return sc.parallelize(ranges, parts).flatMap(_Records(spec))


class _Records:
  def __init__(self, spec: dict):
    self.spec = spec

  def __call__(self, bounds):
    return records(self.spec, bounds[0], bounds[1])


def measure_time(element):
  """MeasureTime.process (its distribution is updated per bundle)."""
  yield element


class _CounterOperation:
  """ParDoTest's CounterOperation.process, Spark accumulators for Beam's
  counters."""
  def __init__(self, counters: list, operations: int):
    self.counters = counters
    self.operations = operations

  def __call__(self, element):
    for _ in range(self.operations):
      for counter in self.counters:
        counter.add(1)
    yield element


def _nothing(_):
  pass


def pardo(sc, options: dict) -> None:
  counters = [sc.accumulator(0) for _ in range(options.get(
      'number_of_counters', 0))]
  rdd = source(sc, options['input_options']).flatMap(measure_time)
  for _ in range(options.get('iterations', 1)):
    rdd = rdd.flatMap(_CounterOperation(
        counters, options.get('number_of_counter_operations', 0)))
  rdd.flatMap(measure_time).foreach(_nothing)


def assign_timestamps(element):
  """AssignTimestamps.process: the timestamp (micros) carried with the
  value, which the grouping keeps with it."""
  key, value = element
  yield key, (value, int(time.time() * 1000000))


class _Ungroup:
  """GroupByKeyTest.ungroup_and_reiterate."""
  def __init__(self, iterations: int):
    self.iterations = iterations

  def __call__(self, element):
    key, value = element
    for i in range(self.iterations):
      for v in value:
        if i == self.iterations - 1:
          return key, v
    return None


def measure_latency(element):
  """MeasureLatency.process: the latency from the element's timestamp."""
  _, (_, micros) = element
  _ = int(time.time() * 1000) - micros // 1000
  yield element


def group_by_key(sc, options: dict) -> None:
  timestamped = source(sc, options['input_options']).flatMap(
      measure_time).flatMap(assign_timestamps)
  fanout = options.get('fanout', 1)
  if fanout > 1:
    timestamped = timestamped.cache()
  for _ in range(fanout):
    (timestamped.groupByKey().map(_Ungroup(options.get('iterations', 1)))
     .flatMap(measure_latency).flatMap(measure_time).foreach(_nothing))
  timestamped.unpersist()


def combine(sc, options: dict) -> None:
  """CombineTest: the top ``top_count`` records (TopCombineFn globally:
  the largest, compared as Python compares them)."""
  rdd = source(sc, options['input_options']).flatMap(measure_time)
  fanout = options.get('fanout', 1)
  if fanout > 1:
    rdd = rdd.cache()
  for _ in range(fanout):
    sc.parallelize(rdd.top(options['top_count']), 1).flatMap(
        measure_time).foreach(_nothing)
  rdd.unpersist()


class _UngroupBoth:
  """CoGroupByKeyTest._UngroupAndReiterate."""
  def __init__(self, iterations: int):
    self.iterations = iterations

  def __call__(self, element):
    inputs, co_inputs = element[1]
    for i in range(self.iterations):
      for value in inputs:
        if i == self.iterations - 1:
          yield value
      for value in co_inputs:
        if i == self.iterations - 1:
          yield value


def co_group_by_key(sc, options: dict) -> None:
  pc1 = source(sc, options['input_options']).flatMap(measure_time)
  pc2 = source(sc, options['co_input_options']).flatMap(measure_time)
  (pc1.cogroup(pc2).flatMap(_UngroupBoth(options.get('iterations', 1)))
   .flatMap(measure_time).foreach(_nothing))


class _Access:
  """SideInputTest's MappingSideInputTestDoFn: the first ``n`` keys of
  the side input, each looked up."""
  def __init__(self, side, n: int):
    self.side = side
    self.n = n

  def __call__(self, _):
    side = self.side.value
    i = 0
    for key in side:
      if i == self.n:
        break
      side[key]  # pylint: disable=pointless-statement
      i += 1
    return []


def side_input(sc, options: dict) -> None:
  """SideInputTest with a dict side input and one window."""
  spec = options['input_options']
  side = sc.broadcast(dict(source(sc, spec).collect()))
  try:
    n = spec['num_records'] * options.get('access_percentage', 100) // 100
    sc.parallelize([0], 1).flatMap(measure_time).flatMap(
        _Access(side, n)).flatMap(measure_time).foreach(_nothing)
  finally:
    side.destroy()


JOBS = {
    'pardo': pardo,
    'group_by_key': group_by_key,
    'combine': combine,
    'co_group_by_key': co_group_by_key,
    'side_input': side_input,
}
