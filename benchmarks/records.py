"""Per-record functions of the benchmark workloads, shared by the Beam and
the hand-written PySpark versions.

This module imports no Beam: workers of the hand-written jobs import it (the
functions are pickled by reference) and must not pay for Beam's modules.
"""

from __future__ import annotations

import re
from typing import Iterator

_WORD = re.compile(r"[\w']+", re.UNICODE)  # as Beam's examples/wordcount.py


def split_words(line: str) -> list[str]:
  return _WORD.findall(line)


def extract_words(line: str) -> list[str]:
  """As Beam's examples/wordcount.py's WordExtractingDoFn.process: the
  pattern compiled by ``re``'s cache at each call."""
  return re.findall(r'[\w\']+', line, re.UNICODE)


def pair_one(word: str):
  return word, 1


def format_count(kv) -> str:
  return '%s: %d' % kv


def parse_tab_kv(line: str):
  key, value = line.split('\t', 1)
  return key, int(value)


def summarize_group(kv) -> str:
  """A GroupByKey's values: how many, their sum, min and max."""
  key, values = kv
  n = total = 0
  lo = hi = None
  for v in values:
    n += 1
    total += v
    if lo is None or v < lo:
      lo = v
    if hi is None or v > hi:
      hi = v
  return '%s\t%d\t%d\t%d\t%d' % (key, n, total, lo, hi)


def parse_comma_kv(line: str):
  key, value = line.split(',', 1)
  return key, int(value)


def format_sum(kv) -> str:
  return '%s,%d' % kv


def parse_dim(line: str):
  user, country = line.split(',', 1)
  return user, country


def join_fact(line: str, dims) -> list[str]:
  """order,user,amount -> order,user,country,amount; no match, no output."""
  order, user, amount = line.split(',')
  country = dims.get(user)
  if country is None:
    return []
  return ['%s,%s,%s,%s' % (order, user, country, amount)]


class JoinFact:
  """``join_fact`` over a broadcast dict, for the hand-written version."""
  def __init__(self, broadcast):
    self.broadcast = broadcast

  def __call__(self, line: str) -> list[str]:
    return join_fact(line, self.broadcast.value)


# -- the large-key benchmark (benchmarks/large_key.py) ---------------------------

HOT_KEY = 'hot'


class KeyedValues:
  """shard -> (key, value bytes): the hot key's share of values, then some
  values for each of a few small keys.  Values are pseudo-random (seeded by
  shard), so Spark's shuffle compression cannot shrink them."""
  def __init__(self, per_shard: int, value_bytes: int, cold_keys: int):
    self.per_shard = per_shard
    self.value_bytes = value_bytes
    self.cold_keys = cold_keys

  def __call__(self, shard: int):
    import random
    rng = random.Random(shard)
    for _ in range(self.per_shard):
      yield HOT_KEY, rng.randbytes(self.value_bytes)
    for k in range(self.cold_keys):
      yield 'cold%03d' % k, rng.randbytes(self.value_bytes)


def summarize_bytes_group(kv) -> str:
  """key, count, total bytes, sum of the values' crc32 (order-independent);
  iterates the values once, holding none of them."""
  import zlib
  key, values = kv
  n = total = crc = 0
  for v in values:
    n += 1
    total += len(v)
    crc += zlib.crc32(v)
  return '%s\t%d\t%d\t%d' % (key, n, total, crc % (1 << 32))


def summarize_sorted_groups(pairs) -> Iterator[str]:
  """A partition of (key, value) pairs sorted by key -> one summary per key,
  streaming each key's values (what a careful hand-written job does when a
  key may not fit in memory)."""
  import itertools
  import operator
  for key, group in itertools.groupby(pairs, key=operator.itemgetter(0)):
    yield summarize_bytes_group((key, (v for _, v in group)))
