"""The GroupByKey shuffle as encoded bytes.

Map side: each element's encoded key picks its reduce partition (crc32, the
same in every process), and the (key, element) records bound for one
partition are packed into chunks of about 1 MiB.  Spark shuffles the chunks:
one pickled record per megabyte, not one per element.

Reduce side: ``ExternalGrouper`` groups the records by key in memory while
they fit in a byte budget; past it, it writes the records sorted by key to a
run file on local disk and starts again.  The groups then come out of a
streaming merge of the runs, so one key may hold far more than the Python
worker's memory.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import os
import struct
import tempfile
import zlib
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.coders.coder_impl import create_OutputStream

from beam_pyspark.worker.elements import CHUNK_BYTES

# What one record costs in memory besides its bytes: two bytes objects, a
# list slot; a new key adds a dict entry and a list.
RECORD_OVERHEAD = 90
KEY_OVERHEAD = 160
# Run files merged at once; more runs are merged in rounds first.
MAX_MERGE_FANIN = 32
_HEADER = struct.Struct('>II')


def partition_of(key: bytes, partitions: int) -> int:
  return zlib.crc32(key) % partitions


def keyed_records(wv_coder_impl, key_coder_impl,
                  chunks: Iterable[bytes]) -> Iterator[tuple[bytes, bytes]]:
  """(encoded key, encoded windowed element) per element of ``chunks``.

  The element's bytes are sliced from the chunk, not re-encoded; the key is
  the runner-safe coder's bytes (a length-prefixed user key stays opaque).
  """
  encode_key = key_coder_impl.encode_nested
  for data in chunks:
    stream = create_InputStream(data)
    total = len(data)
    start = 0
    while stream.size() > 0:
      wv = wv_coder_impl.decode_from_stream(stream, True)
      end = total - stream.size()
      key = wv.value[0]
      yield (key if type(key) is bytes else encode_key(key)), data[start:end]
      start = end


class PartitionPacker:
  """Packs (key, element) records into one chunk stream per reduce partition."""
  def __init__(self, partitions: int, limit: int = CHUNK_BYTES):
    self.partitions = partitions
    self.limit = limit
    self._outs: list = [None] * partitions

  def add(self, records: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[int, bytes]]:
    """Yields (partition, chunk) for every chunk that filled up."""
    outs = self._outs
    partitions = self.partitions
    limit = self.limit
    crc32 = zlib.crc32
    for key, element in records:
      p = crc32(key) % partitions
      out = outs[p]
      if out is None:
        out = outs[p] = create_OutputStream()
      out.write_var_int64(len(key))
      out.write(key)
      out.write_var_int64(len(element))
      out.write(element)
      if out.size() >= limit:
        yield p, out.get()
        outs[p] = None

  def flush(self) -> Iterator[tuple[int, bytes]]:
    for p, out in enumerate(self._outs):
      if out is not None and out.size():
        yield p, out.get()
    self._outs = [None] * self.partitions


def unpack_records(chunks: Iterable[bytes]) -> Iterator[tuple[bytes, bytes]]:
  for data in chunks:
    stream = create_InputStream(data)
    while stream.size() > 0:
      key = stream.read(stream.read_var_int64())
      yield key, stream.read(stream.read_var_int64())


class ExternalGrouper:
  """Groups (key, element) records within ``budget`` bytes of memory."""
  def __init__(self, budget: int, spill_dir: Optional[str] = None):
    self.budget = budget
    self.spill_dir = spill_dir
    self._groups: dict[bytes, list[bytes]] = {}
    self._used = 0
    self._runs: list[str] = []
    self.spilled_bytes = 0
    self.runs_written = 0

  def add_all(self, records: Iterable[tuple[bytes, bytes]]) -> None:
    groups = self._groups
    used = self._used
    budget = self.budget
    for key, element in records:
      values = groups.get(key)
      if values is None:
        values = groups[key] = []
        used += len(key) + KEY_OVERHEAD
      values.append(element)
      used += len(element) + RECORD_OVERHEAD
      if used > budget:
        self._spill()
        used = 0
    self._used = used

  def _spill(self) -> None:
    os.makedirs(self.spill_dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix='run-', dir=self.spill_dir)
    self._runs.append(path)
    self.runs_written += 1
    with os.fdopen(fd, 'wb', buffering=CHUNK_BYTES) as f:
      pack = _HEADER.pack
      groups = self._groups
      for key in sorted(groups):
        for element in groups[key]:
          f.write(pack(len(key), len(element)))
          f.write(key)
          f.write(element)
          self.spilled_bytes += _HEADER.size + len(key) + len(element)
      groups.clear()
    if len(self._runs) > MAX_MERGE_FANIN:
      self._merge_runs()

  def _merge_runs(self) -> None:
    """Merges the oldest runs into one, bounding the final merge's fan-in."""
    merging, self._runs = self._runs[:MAX_MERGE_FANIN], self._runs[MAX_MERGE_FANIN:]
    fd, path = tempfile.mkstemp(prefix='run-', dir=self.spill_dir)
    try:
      with os.fdopen(fd, 'wb', buffering=CHUNK_BYTES) as f:
        pack = _HEADER.pack
        for key, element in heapq.merge(
            *[_read_run(r) for r in merging], key=operator.itemgetter(0)):
          f.write(pack(len(key), len(element)))
          f.write(key)
          f.write(element)
    finally:
      for r in merging:
        _remove(r)
    self._runs.insert(0, path)

  @property
  def spilled(self) -> bool:
    return bool(self._runs)

  def groups(self) -> Iterator[tuple[bytes, Iterator[bytes]]]:
    """(key, its elements), each key once; the elements stream from disk
    when the records were spilled.  Consume each group before the next."""
    if not self._runs:
      groups = self._groups
      while groups:
        key, values = groups.popitem()
        yield key, iter(values)
      return
    try:
      memory = [(k, e) for k in sorted(self._groups) for e in self._groups[k]]
      self._groups = {}
      merged = heapq.merge(
          *[_read_run(r) for r in self._runs], iter(memory),
          key=operator.itemgetter(0))
      for key, records in itertools.groupby(merged, operator.itemgetter(0)):
        yield key, (element for _, element in records)
    finally:
      self.close()

  def close(self) -> None:
    runs, self._runs = self._runs, []
    for r in runs:
      _remove(r)
    self._groups = {}


def _read_run(path: str) -> Iterator[tuple[bytes, bytes]]:
  with open(path, 'rb', buffering=CHUNK_BYTES) as f:
    read = f.read
    unpack = _HEADER.unpack
    size = _HEADER.size
    while True:
      header = read(size)
      if not header:
        return
      key_len, element_len = unpack(header)
      yield read(key_len), read(element_len)


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass


def is_global_bytes_kv(coder) -> bool:
  """A runner-safe WindowedValue<KV<bytes, bytes>> in the global window:
  the shape of almost every GroupByKey input, whose grouping needs only
  each element's key and value bytes (``kv_value_records``)."""
  from apache_beam.coders import coders
  if type(coder) is not coders.WindowedValueCoder:
    return False
  if type(coder.window_coder) is not coders.GlobalWindowCoder:
    return False
  kv = coder.wrapped_value_coder
  return (
      type(kv) is coders.TupleCoder and len(kv.coders()) == 2 and
      all(type(c) is coders.BytesCoder for c in kv.coders()))


def kv_value_records(chunks: Iterable[bytes]) -> Iterator[tuple[bytes, bytes]]:
  """(key, the value's nested encoding) per global-window KV<bytes, bytes>
  element, read from the bytes without building a WindowedValue.

  With the default windowing the reduce side stamps its own timestamp,
  window and pane, so only these travel: timestamp (8 bytes), windows
  (int32 count; a global window is empty), pane (a byte, then 0-2 varint
  indices by its encoding), key (varint length, bytes), value (varint
  length, bytes).
  """
  for data in chunks:
    stream = create_InputStream(data)
    total = len(data)
    while stream.size() > 0:
      stream.read(8)
      stream.read_bigendian_int32()
      encoding = stream.read_byte() >> 4
      if encoding == 1:
        stream.read_var_int64()
      elif encoding == 2:
        stream.read_var_int64()
        stream.read_var_int64()
      key = stream.read(stream.read_var_int64())
      start = total - stream.size()
      stream.read(stream.read_var_int64())
      yield key, data[start:total - stream.size()]
