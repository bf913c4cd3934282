"""Beam's synthetic records and the hand-written PySpark load tests.

``records`` makes the records Beam's ``SyntheticSource`` reads with its
default ('builtin') generator, byte for byte, as its ``read`` does
(``_gen_kv_pair``: the generator seeded with the record's index, a hot key
drawn from a second generator; and ``time.sleep`` of the spec's delay per
record, 0 here, which is a yield of the CPU: on a busy machine it costs
wall time, in Beam's source and here alike). The jobs below do by hand what Beam's load tests
(``apache_beam.testing.load_tests``) do, as a PySpark user would write
them. This module imports no Beam: the hand-written jobs' Python workers
import it (README, Benchmarks).
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
  return sc.parallelize(ranges, parts).flatMap(
      lambda r: records(spec, r[0], r[1]))


class _CounterOperation:
  """ParDoTest's CounterOperation: ``operations`` updates of each of
  ``counters`` counters per element, kept per partition and added to
  Spark accumulators at its end (a user would not update an accumulator
  per element)."""
  def __init__(self, accumulators, operations: int):
    self.accumulators = accumulators
    self.operations = operations

  def __call__(self, items):
    n = 0
    for item in items:
      n += 1
      yield item
    for accumulator in self.accumulators:
      accumulator.add(n * self.operations)


def pardo(sc, options: dict) -> None:
  rdd = source(sc, options['input_options'])
  counters = [sc.accumulator(0) for _ in range(options.get(
      'number_of_counters', 0))]
  for _ in range(options.get('iterations', 1)):
    if counters:
      rdd = rdd.mapPartitions(_CounterOperation(
          counters, options.get('number_of_counter_operations', 0)))
    else:
      rdd = rdd.map(_identity)
  rdd.foreach(_nothing)


def _identity(x):
  return x


def _nothing(_):
  pass


def ungroup_and_reiterate(element, iterations: int):
  """GroupByKeyTest.ungroup_and_reiterate."""
  key, value = element
  for i in range(iterations):
    for v in value:
      if i == iterations - 1:
        return key, v
  return None


class _Ungroup:
  def __init__(self, iterations: int):
    self.iterations = iterations

  def __call__(self, element):
    return ungroup_and_reiterate(element, self.iterations)


def group_by_key(sc, options: dict) -> None:
  rdd = source(sc, options['input_options'])
  fanout = options.get('fanout', 1)
  if fanout > 1:
    rdd = rdd.cache()
  for _ in range(fanout):
    rdd.groupByKey().map(_Ungroup(options.get('iterations', 1))).foreach(
        _nothing)
  rdd.unpersist()


def combine(sc, options: dict) -> None:
  """CombineTest: the top ``top_count`` records (TopCombineFn globally:
  the largest, compared as Python compares them)."""
  rdd = source(sc, options['input_options'])
  fanout = options.get('fanout', 1)
  if fanout > 1:
    rdd = rdd.cache()
  for _ in range(fanout):
    rdd.top(options['top_count'])
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
  pc1 = source(sc, options['input_options'])
  pc2 = source(sc, options['co_input_options'])
  pc1.cogroup(pc2).flatMap(_UngroupBoth(options.get('iterations', 1))
                           ).foreach(_nothing)


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


def side_input(sc, options: dict) -> None:
  """SideInputTest with a dict side input and one window."""
  spec = options['input_options']
  side = sc.broadcast(dict(source(sc, spec).collect()))
  try:
    n = spec['num_records'] * options.get('access_percentage', 100) // 100
    sc.parallelize([0], 1).foreach(_Access(side, n))
  finally:
    side.destroy()


JOBS = {
    'pardo': pardo,
    'group_by_key': group_by_key,
    'combine': combine,
    'co_group_by_key': co_group_by_key,
    'side_input': side_input,
}
