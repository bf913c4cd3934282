"""Which value of a DataFrame's int column lands in which partition.

The RDD engine puts each chunk of records in the reduce partition its
producer chose (``worker.shuffle.PartitionPacker``, crc32 of the encoded
key). Over the DataFrame API the shuffle is ``repartition(n, 'part')``,
which places a row by Spark's Murmur3 hash of the column (seed 42, as
``HashPartitioning``), modulo n. ``targets(n)[p]`` is an int whose hash
lands in partition ``p``: writing it for chunks bound for ``p`` keeps
today's placement, one reduce partition per chosen partition, with no
two of them piled into one task.
"""

from __future__ import annotations

import functools

_MASK = 0xFFFFFFFF
SEED = 42


def _rotl(x: int, r: int) -> int:
  return ((x << r) | (x >> (32 - r))) & _MASK


def spark_hash_int(value: int, seed: int = SEED) -> int:
  """Spark's ``Murmur3_x86_32.hashInt`` (the SQL ``hash`` of an int), as
  a signed 32-bit int."""
  k1 = (value & _MASK) * 0xCC9E2D51 & _MASK
  k1 = _rotl(k1, 15) * 0x1B873593 & _MASK
  h1 = (seed & _MASK) ^ k1
  h1 = (_rotl(h1, 13) * 5 + 0xE6546B64) & _MASK
  h1 ^= 4
  h1 ^= h1 >> 16
  h1 = h1 * 0x85EBCA6B & _MASK
  h1 ^= h1 >> 13
  h1 = h1 * 0xC2B2AE35 & _MASK
  h1 ^= h1 >> 16
  return h1 - (1 << 32) if h1 & 0x80000000 else h1


def partition_of(value: int, partitions: int) -> int:
  """The partition ``repartition(partitions, col)`` puts ``value`` in."""
  return spark_hash_int(value) % partitions  # Python's % is Spark's pmod


@functools.lru_cache(maxsize=64)
def targets(partitions: int) -> tuple[int, ...]:
  """For each partition, the smallest non-negative int that lands there."""
  found: dict[int, int] = {}
  value = 0
  while len(found) < partitions:
    found.setdefault(partition_of(value, partitions), value)
    value += 1
  return tuple(found[p] for p in range(partitions))
