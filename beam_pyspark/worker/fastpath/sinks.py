"""Where a fast-path loop's outputs go, written as the harness writes them.

* RECORDS: a GroupByKey's shuffle records of key and value bytes, packed
  per reduce partition as ``worker.shuffle.PartitionPacker`` packs the
  harness's (the compact shape: ``worker.shuffle.kv_value_records`` reads
  the same bytes from an encoded element);
* ENCODED: elements encoded with the output's coder, in their windows,
  timestamp and pane; the caller keys them for a shuffle as it keys the
  harness's, or they feed the harness that runs the rest of the stage;
* TABLE: a precombine's accumulators, kept as ``PGBKCVOperation`` keeps
  them (Beam's own accumulators, in a dict whose insertion order is the
  eviction order, emptied of its oldest tenth past ``max_keys``, and at
  the end of each bundle), keyed by (window, key) where the windowing is
  not the default one, and written to a RECORDS or ENCODED sink;
* DISCARD: a PCollection nothing reads (counted only).

Each sink gives ``codegen`` its code (``hold``, ``put``, ``put_held``,
``commit``), in which its state has names of its own (``table3``...),
and chunks ready to leave go to the loop's shared ``ready`` list as
(output id, chunk) pairs, chunk a (reduce partition, bytes) pair for
records.
"""

from __future__ import annotations

import heapq
import zlib
from typing import Optional

from apache_beam.coders import coders
from apache_beam.coders.coder_impl import create_OutputStream
from apache_beam.transforms import core
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.fastpath import outputs

_GLOBAL = GlobalWindows.windowed_value(None)
RECORDS, ENCODED, TABLE, DISCARD = 'records', 'encoded', 'table', 'discard'

# A precombine's input that may be a TimestampedValue or WindowedValue
# (unchecked, codegen.output): it stands for its value.
_UNPACK = """
try:
  k, val = {x}
except Exception:
  k, val = unwrap({x})"""

_RECORD = """
k, val = {x}
kb = encode_key{s}(k)
p = crc32(kb) % partitions{s}
out = streams{s}[p]
if out is None:
  out = streams{s}[p] = OutputStream()
vb = encode_value{s}(val)
out.write_var_int64(len(kb))
out.write(kb)
out.write_var_int64(len(vb))
out.write(vb)
if out.size() >= limit:
  ready.append((oid{s}, (p, out.get())))
  streams{s}[p] = None"""

_ENCODE = """
out = streams{s}[0]
encode{s}({wv}, out, True)
if out.size() >= limit:
  ready.append((oid{s}, out.get()))
  streams{s}[0] = OutputStream()"""

# add_input per combine kind, into the table entry of key ``wk``: Beam's
# own (a call), and CallableWrapperCombineFn's, CountCombineFn's and
# MeanCombineFn's, inlined as they are written.
_ADD = {
    'generic': """
acc = table{s}.get(wk, MISSING)
if acc is MISSING:
  if len(table{s}) >= max_keys{s}:
    evict{s}()
  acc = create_accumulator{s}()
table{s}[wk] = add_input{s}(acc, val)""",
    'callable': """
acc = table{s}.get(wk)
if acc is None:
  if len(table{s}) >= max_keys{s}:
    evict{s}()
  acc = table{s}[wk] = []
acc.append(val)
if len(acc) > buffer_size{s}:
  table{s}[wk] = [combine_fn{s}(acc)]""",
    'count': """
acc = table{s}.get(wk)
if acc is None:
  if len(table{s}) >= max_keys{s}:
    evict{s}()
  acc = 0
table{s}[wk] = acc + 1""",
    'mean': """
acc = table{s}.get(wk)
if acc is None:
  if len(table{s}) >= max_keys{s}:
    evict{s}()
  acc = (0, 0)
table{s}[wk] = (acc[0] + val, acc[1] + 1)""",
    # TopCombineFn's add_input in its default order (no key, not reversed:
    # the elements themselves in the heap): heappush, or heappushpop's
    # own test and replacement, on the same heap in the same order.
    'top': """
acc = table{s}.get(wk)
if acc is None:
  if len(table{s}) >= max_keys{s}:
    evict{s}()
  acc = table{s}[wk] = (False, [])
heap = acc[1]
if len(heap) < top_n{s}:
  heappush(heap, val)
elif heap[0] < val:
  heapreplace(heap, val)""",
}


def unwrap(x) -> tuple:
  """A precombine's input that did not unpack: a TimestampedValue or
  WindowedValue stands for its value; a TaggedOutput goes elsewhere."""
  if isinstance(x, chains.TaggedOutput):
    raise chains.SpecialOutput('an output is a TaggedOutput')
  if isinstance(x, (chains.TimestampedValue, WindowedValue)):
    x = x.value
  k, v = x
  return k, v


def _lines(template: str, **fields) -> list[str]:
  return [line for line in template.format(**fields).strip('\n').split('\n')
          if line]


class Sink:
  """One sink of a loop; ``names`` are its state for the loop's code."""
  def __init__(self, index: int, kind: str, output_id: str, ready: list,
               limit: int):
    self.index = index
    self.kind = kind
    self.output_id = output_id
    self.ready = ready
    self.limit = limit
    self.names: dict = {f'oid{index}': output_id}
    self.streams: list = []

  # -- code ----------------------------------------------------------------

  def hold(self, x: str, m: str) -> str:
    """What the loop holds of an output until its element is done."""
    return f'{m}.with_value({x})' if self.kind == ENCODED else x

  def put(self, x: str, m: str) -> list[str]:
    """Code writing one output ``x`` in meta ``m`` at once."""
    return self.put_held(self.hold(x, m))

  def put_held(self, h: str) -> list[str]:
    s = self.index
    if self.kind == RECORDS:
      return _lines(_RECORD, x=h, s=s)
    if self.kind == ENCODED:
      return _lines(_ENCODE, wv=h, s=s)
    return []

  def commit(self, held: str) -> list[str]:
    """Code writing every output held in the list ``held``."""
    return [f'for hx in {held}:'] + [
        '  ' + line for line in self.put_held('hx')]

  # -- state ---------------------------------------------------------------

  def flush_streams(self) -> None:
    """Whatever the streams hold, to ``ready``."""
    for p, out in enumerate(self.streams):
      if out is not None and out.size():
        self.ready.append(
            (self.output_id, (p, out.get()) if self.kind == RECORDS else
             out.get()))
    if self.kind == RECORDS:
      self.streams[:] = [None] * len(self.streams)
    elif self.streams:
      self.streams[0] = create_OutputStream()


def output_sink(index: int, output_id: str, coder, group, ready: list,
                limit: int) -> Sink:
  """The sink of a DATA_OUTPUT (``coder``: its windowed coder; ``group``:
  (reduce partitions, compact) when it feeds a GroupByKey)."""
  compact = compact_coders(coder) if group and group[1] else None
  if compact is not None:
    sink = Sink(index, RECORDS, output_id, ready, limit)
    encode_key, encode_value = compact
    sink.streams = [None] * group[0]
    sink.names.update({
        f'encode_key{index}': encode_key,
        f'encode_value{index}': encode_value,
        f'partitions{index}': group[0], f'streams{index}': sink.streams})
  else:
    sink = Sink(index, ENCODED, output_id, ready, limit)
    sink.streams = [create_OutputStream()]
    sink.names.update({f'encode{index}': coder.get_impl().encode_to_stream,
                       f'streams{index}': sink.streams})
  sink.names.update(limit=limit, crc32=zlib.crc32,
                    OutputStream=create_OutputStream)
  return sink


class Table(Sink):
  """A precombine's table (``call``: its chain.Call), written to ``out``."""
  def __init__(self, index: int, call: chains.Call, out: Sink):
    super().__init__(index, TABLE, out.output_id, out.ready, out.limit)
    combine = call.combine
    self.out = out
    self.transform_id = call.step.transform_id
    self.combine_kind = call.combine_kind
    self.windowed = not call.windowing.is_default()
    # (size, offset) in microseconds when a FixedWindows assignment alone
    # feeds the table (codegen): keyed by (the window's start, key), an
    # int hashed in C, the window made when its accumulator leaves.
    self.starts: Optional[tuple[int, int]] = None
    self._windows: dict = {}
    self.table: dict = {}
    self.accumulators = 0
    self._compact = compact_of(combine)
    self.names.update({
        f'table{index}': self.table, f'max_keys{index}': call.max_keys,
        f'evict{index}': self.evict,
        f'create_accumulator{index}': combine.create_accumulator,
        f'add_input{index}': combine.add_input,
        f'buffer_size{index}': getattr(combine, '_buffer_size', 0),
        f'combine_fn{index}': getattr(combine, '_fn', None),
        f'top_n{index}': getattr(combine, '_n', 0),
        'heappush': heapq.heappush, 'heapreplace': heapq.heapreplace,
        'MISSING': chains.MISSING, 'unwrap': unwrap})
    self.names.update(out.names)
    self._encode = out.names.get(f'encode{out.index}')

  def hold(self, x: str, m: str) -> str:
    return f'({x}, {m})' if self.windowed else x

  def key_by_start(self, window_fn) -> None:
    self.starts = (window_fn.size.micros, window_fn.offset.micros)

  def put_held(self, h: str) -> list[str]:
    s = self.index
    add = _lines(_ADD[self.combine_kind], s=s)
    if self.starts is not None:
      return [f'hv, st = {h}', 'k, val = hv', 'wk = (st, k)'] + add
    if not self.windowed:
      return _lines(_UNPACK, x=h) + ['wk = k'] + add
    return [f'hv, mx = {h}', 'k, val = hv', 'for win in mx.windows:',
            '  wk = (win, k)'] + ['  ' + line for line in add]

  def commit(self, held: str) -> list[str]:
    if self.windowed:
      return [f'for hz in {held}:'] + [
          '  ' + line for line in self.put_held('hz')]
    return super().commit(held)

  def _output(self, wkey, acc) -> None:
    value = acc if self._compact is None else self._compact(acc)
    if self.starts is not None:
      start, key = wkey
      window = self._windows.get(start)
      if window is None:
        if len(self._windows) >= 1024:
          self._windows.clear()
        window = self._windows[start] = outputs.fixed_window(
            start, self.starts[0])
      self._put(WindowedValue((key, value), window.max_timestamp(),
                              (window, )))
    elif self.windowed:
      window, key = wkey
      self._put(WindowedValue((key, value), window.max_timestamp(),
                              (window, )))
    else:
      self._put(_GLOBAL.with_value((wkey, value)))
    self.accumulators += 1

  def _put(self, wv) -> None:
    out = self.out
    if out.kind == RECORDS:
      key, value = wv.value
      names, s = out.names, out.index
      kb = names[f'encode_key{s}'](key)
      vb = names[f'encode_value{s}'](value)
      p = zlib.crc32(kb) % names[f'partitions{s}']
      stream = out.streams[p]
      if stream is None:
        stream = out.streams[p] = create_OutputStream()
      stream.write_var_int64(len(kb))
      stream.write(kb)
      stream.write_var_int64(len(vb))
      stream.write(vb)
      if stream.size() >= self.limit:
        self.ready.append((self.output_id, (p, stream.get())))
        out.streams[p] = None
    else:
      stream = out.streams[0]
      self._encode(wv, stream, True)
      if stream.size() >= self.limit:
        self.ready.append((self.output_id, stream.get()))
        out.streams[0] = create_OutputStream()

  def evict(self) -> None:
    # PGBKCVOperation.add_key_value: the oldest keys leave, down to 90%.
    table = self.table
    target = len(table) * 9 // 10
    old = []
    for key, acc in table.items():
      old.append(key)
      self._output(key, acc)
      if len(table) - len(old) <= target:
        break
    for key in old:
      del table[key]

  def flush_table(self) -> None:
    """The bundle's end (PGBKCVOperation.finish): every accumulator out;
    an UNCLEAN Fallback if the combine or an encoder fails."""
    try:
      for key, acc in self.table.items():
        self._output(key, acc)
    except Exception as exn:  # pylint: disable=broad-except
      raise chains.Fallback(chains.UNCLEAN, None, None, exn) from exn
    self.table.clear()

  def flush_streams(self) -> None:
    pass  # its output sink's


def discard(index: int) -> Sink:
  return Sink(index, DISCARD, '', [], 0)


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


def compact_of(combine) -> Optional[object]:
  """The CombineFn's compact, if it overrides Beam's (PGBKCVOperation)."""
  if type(combine).compact is core.CombineFn.compact:
    return None
  return combine.compact
