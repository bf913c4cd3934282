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
