"""Stable partitioning of encoded keys.

PySpark's default partitioner hashes with Python's ``hash``, which differs
between processes unless PYTHONHASHSEED is fixed; two tasks could then send
the same key to different partitions.  crc32 of the encoded key is the same
everywhere.
"""

import zlib


def stable_hash(key: bytes) -> int:
  return zlib.crc32(key)


def pack_by_size(sizes: list[float], bins: int) -> list[list[int]]:
  """Indices of ``sizes`` packed into ``bins`` bins, largest first.

  Greedy longest-processing-time: each item goes to the currently lightest
  bin.  Round-robin placement left one 15 s straggler in a 50 MB job.
  """
  bins = max(1, min(bins, len(sizes)))
  loads = [0.0] * bins
  packed: list[list[int]] = [[] for _ in range(bins)]
  for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    lightest = min(range(bins), key=loads.__getitem__)
    packed[lightest].append(index)
    loads[lightest] += max(sizes[index], 0.0)
  return [b for b in packed if b]


def shuffle_chunks(rdd, partitions: int):
  """(reduce partition, chunk) records -> an RDD of the chunks, shuffled.

  PySpark's ``partitionBy`` batches records per bucket before pickling
  them: up to ``10 * partitions`` records at a time, which with chunks of
  a megabyte held hundreds of megabytes per map task (a MemoryError in
  the large-key benchmark). This is the same JVM path (PairwiseRDD,
  PythonPartitioner) with each chunk pickled and handed on at once, so a
  map task holds one chunk.
  """
  from pyspark.core.rdd import RDD
  from pyspark.serializers import BatchedSerializer
  from pyspark.serializers import pack_long
  from pyspark.traceback_utils import SCCallSiteSync

  ctx = rdd.ctx
  serializer = ctx._unbatched_serializer

  def add_shuffle_key(_, records):
    dumps = serializer.dumps
    for partition, chunk in records:
      yield pack_long(partition % partitions)
      yield dumps([chunk])

  keyed = rdd.mapPartitionsWithIndex(add_shuffle_key, preservesPartitioning=True)
  keyed._bypass_serializer = True
  with SCCallSiteSync(ctx):
    pairs = ctx._jvm.PairwiseRDD(keyed._jrdd.rdd()).asJavaPairRDD()
    partitioner = ctx._jvm.PythonPartitioner(partitions, id(shuffle_chunks))
  jrdd = ctx._jvm.PythonRDD.valueOfPair(pairs.partitionBy(partitioner))
  return RDD(jrdd, ctx, BatchedSerializer(serializer))
