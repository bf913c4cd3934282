"""Cutting PySpark's chains of pipelined task functions.

PySpark composes each ``map``/``mapPartitions`` of a ``PipelinedRDD`` into
the function before it, and pickles the whole chain, nested as deep as it
is long, into the task. A pipeline of many stages that do not fuse (150
ParDos, each in an environment of its own) made one chain hundreds deep,
which the pickler refused ("excessively deep recursion required"). A cut
makes the chain so far a Java RDD of its own and starts a new chain on it;
the elements cross the JVM once, pickled in batches, as at any shuffle.
"""

from __future__ import annotations

from pyspark.core.rdd import RDD, PipelinedRDD

# Functions composed before a cut: each stage adds about three (its tag,
# its run, its untag), and one level costs the pickler a few frames of
# Python's 1,000.
MAX_DEPTH = 48


def depth(rdd) -> int:
  """How many functions ``rdd``'s task runs composed in one chain."""
  n = 0
  while isinstance(rdd, PipelinedRDD) and rdd._is_pipelinable():  # pylint: disable=protected-access
    n += 1
    rdd = rdd.prev
  return n


def cut_if_deep(rdd, max_depth: int = MAX_DEPTH):
  """``rdd``, or the same elements as the start of a new chain when its
  chain is deeper than ``max_depth``."""
  if depth(rdd) <= max_depth:
    return rdd
  # pylint: disable=protected-access
  cut = RDD(rdd._jrdd, rdd.ctx, rdd._jrdd_deserializer)
  cut.partitioner = rdd.partitioner
  return cut
