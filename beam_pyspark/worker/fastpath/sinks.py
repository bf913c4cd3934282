"""Where a fast-path loop's outputs go, written as the harness writes them.

* TABLE: the precombine's accumulators, kept as ``PGBKCVOperation`` keeps
  them (Beam's own accumulators, in a dict whose insertion order is the
  eviction order, emptied of its oldest tenth past ``max_keys``) and
  emitted as the elements the precombine outputs;
* RECORDS: a GroupByKey's shuffle records of key and value bytes, packed
  per reduce partition as ``worker.shuffle.PartitionPacker`` packs the
  harness's (the compact shape: ``worker.shuffle.kv_value_records`` reads
  the same bytes from an encoded element);
* ENCODED: elements encoded with the output's coder, in the input
  element's window, timestamp and pane; the caller keys them for a
  shuffle as it keys the harness's, or they feed the harness that runs
  the rest of the stage.

``names`` are what the compiled loop reads (``chain.compile_loop``);
``flush`` empties the table and the streams.
"""

from __future__ import annotations

import uuid
import zlib
from typing import Iterator
from typing import Optional

from apache_beam.coders import coders
from apache_beam.coders.coder_impl import create_OutputStream
from apache_beam.transforms import core
from apache_beam.transforms.window import GlobalWindows

from beam_pyspark.worker.fastpath import chain as chains

_GLOBAL = GlobalWindows.windowed_value(None)


class Sink:
  """``group``: (reduce partitions, compact) when the output feeds a
  GroupByKey; ``coder``: the output's windowed coder; ``limit``: chunk
  bytes."""
  def __init__(self, coder, group: Optional[tuple[int, bool]],
               chain: chains.Chain, limit: int):
    self.ready: list = []
    self.accumulators = 0
    self.table: Optional[dict] = None
    self.names = {'ready': self.ready, 'limit': limit,
                  'OutputStream': create_OutputStream}
    compact = compact_coders(coder) if group and group[1] else None
    self.records = compact is not None
    if compact is not None:
      self._emit = self._records_sink(compact, group[0], limit)
    else:
      self._emit = self._encoded_sink(coder.get_impl(), limit)
    if chain.combine is not None:
      self.kind = chains.TABLE
      self._table_sink(chain)
    else:
      self.kind = chains.RECORDS if self.records else chains.ENCODED

  def _records_sink(self, compact, partitions: int, limit: int):
    encode_key, encode_value = compact
    ready = self.ready
    self.streams = streams = [None] * partitions
    self.names.update(encode_key=encode_key, encode_value=encode_value,
                      crc32=zlib.crc32, partitions=partitions, streams=streams)

    def emit(key, value):
      kb = encode_key(key)
      vb = encode_value(value)
      p = zlib.crc32(kb) % partitions
      out = streams[p]
      if out is None:
        out = streams[p] = create_OutputStream()
      out.write_var_int64(len(kb))
      out.write(kb)
      out.write_var_int64(len(vb))
      out.write(vb)
      if out.size() >= limit:
        ready.append((p, out.get()))
        streams[p] = None

    return emit

  def _encoded_sink(self, impl, limit: int):
    encode = impl.encode_to_stream
    ready = self.ready
    self.streams = streams = [create_OutputStream()]
    self.names.update(encode=encode, streams=streams)

    def emit(key, value):
      out = streams[0]
      encode(_GLOBAL.with_value((key, value)), out, True)
      if out.size() >= limit:
        ready.append(out.get())
        streams[0] = create_OutputStream()

    return emit

  def _table_sink(self, chain: chains.Chain) -> None:
    combine = chain.combine
    self.table = table = {}
    compact = compact_of(combine)
    emit = self._emit

    def output(key, acc):
      emit(key, acc if compact is None else compact(acc))
      self.accumulators += 1

    def evict():
      # PGBKCVOperation.add_key_value: the oldest keys leave, down to 90%.
      target = len(table) * 9 // 10
      old = []
      for key, acc in table.items():
        old.append(key)
        output(key, acc)
        if len(table) - len(old) <= target:
          break
      for key in old:
        del table[key]

    self._output = output
    self.names.update(
        table=table, max_keys=chain.max_keys, evict=evict,
        create_accumulator=combine.create_accumulator,
        add_input=combine.add_input,
        buffer_size=getattr(combine, '_buffer_size', 0),
        combine_fn=getattr(combine, '_fn', None))

  def put(self, value, meta) -> None:
    """One element, outside the loop (a file writer's result)."""
    if self.records:
      k, v = value
      self._emit(k, v)
    else:
      out = self.streams[0]
      self.names['encode'](meta.with_value(value), out, True)
      if out.size() >= self.names['limit']:
        self.ready.append(out.get())
        self.streams[0] = create_OutputStream()

  def flush(self) -> Iterator:
    """The table's accumulators, then whatever the streams hold: raises
    an UNCLEAN Fallback if the combine or an encoder fails."""
    table = self.table
    if table is not None:
      output = self._output
      try:
        for key, acc in table.items():
          output(key, acc)
      except Exception as exn:  # pylint: disable=broad-except
        raise chains.Fallback(chains.UNCLEAN, None, None, exn) from exn
      table.clear()
    yield from self.ready
    self.ready.clear()
    streams = self.streams
    for p, out in enumerate(streams):
      if out is not None and out.size():
        yield (p, out.get()) if self.records else out.get()
    if self.records:
      streams[:] = [None] * len(streams)
    else:
      streams[0] = create_OutputStream()


def compact_coders(coder):
  """(encode key, encode value) for a compact group's shuffle records
  (worker.shuffle.kv_value_records reads the same from the encoded
  element: the key's bytes, and the value's nested encoding), or None."""
  if type(coder) is not coders.WindowedValueCoder:  # pylint: disable=unidiomatic-typecheck
    return None
  kv = coder.wrapped_value_coder
  if type(kv) is not coders.TupleCoder or len(kv.coders()) != 2:  # pylint: disable=unidiomatic-typecheck
    return None
  key, value = kv.coders()
  if type(key) is coders.LengthPrefixCoder:  # pylint: disable=unidiomatic-typecheck
    encode_key = key.value_coder().get_impl().encode
  elif type(key) is coders.BytesCoder:  # pylint: disable=unidiomatic-typecheck
    encode_key = key.get_impl().encode
  else:
    return None
  if type(value) not in (coders.LengthPrefixCoder, coders.BytesCoder):
    return None
  return encode_key, value.get_impl().encode_nested


def compact_of(combine):
  """The CombineFn's compact, if it overrides Beam's (PGBKCVOperation)."""
  if type(combine).compact is core.CombineFn.compact:
    return None
  return combine.compact


class Writer:
  """Beam's file writer (``iobase._WriteBundleDoFn``, with its one side
  input, the sink's initialization result) as the loop's sink, a task
  being its bundle: opened at the first element, written, closed when at
  capacity and at the end, as its ``process`` and ``finish_bundle`` do.
  What it outputs (a written file's result) goes through the chain's
  ``tail`` (Maps: WriteToText's ``Pair``) to ``out``. ``counts``: its
  outputs, then each tail step's."""
  def __init__(self, call: chains.Call, init_result, tail: list,
               out: Sink):
    self.dofn = call.writer
    self.init_result = init_result
    self.tail = tail
    self.out = out
    self.counts = [0] * (1 + len(tail))
    self.names = dict(out.names)
    self.names['write'] = self.write
    self.dofn.start_bundle()

  def write(self, x, meta) -> None:
    dofn = self.dofn
    if dofn.writer is None:
      dofn.writer = dofn.sink.open_writer(self.init_result,
                                          str(uuid.uuid4()))
    dofn.writer.write(x)
    if dofn.writer.at_capacity():
      result = dofn.writer.close()
      dofn.writer = None
      self._down(result, meta)

  def finish(self) -> None:
    """The bundle's end: the open file is closed and its result output."""
    for wv in self.dofn.finish_bundle() or ():
      self._down(wv.value, wv)

  def abandon(self) -> None:
    """The partition runs again elsewhere: the file is closed, unused."""
    writer, self.dofn.writer = self.dofn.writer, None
    if writer is not None:
      writer.close()

  def _down(self, value, meta) -> None:
    self.counts[0] += 1
    for i, call in enumerate(self.tail):
      if not call.identity:
        value = call.fn(value, *call.args, **(call.kwargs or {}))
      if chains.is_special(value):
        raise chains.SpecialOutput(f'an output is a {type(value).__name__}')
      self.counts[i + 1] += 1
    self.out.put(value, meta)
