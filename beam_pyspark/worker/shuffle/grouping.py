"""The reduce side of GroupByKey: shuffled records -> grouped output.

The records come from ``worker.shuffle``: (encoded key, encoded windowed KV)
packed in chunks.  ``ExternalGrouper`` groups them within a memory budget,
spilling sorted runs to local disk past it.

With the default windowing (global window, default trigger) grouping is
byte work: values stay encoded with the runner-safe coders and the output is
one on-time pane per key.  A key whose values outgrow ``inline_bytes`` is
written with Beam's state-backed iterable form when the consumer allows it
(``paged``): the values past the first ``inline_bytes`` go to a page file and
reach the harness page by page (``worker.shuffle.paging``), so no list of them is
built.  Any other windowing decodes with the SDK's data channel coders and
runs Beam's batch trigger driver per key, which gives merging windows,
custom windows, timestamp combiners and batch triggers; that driver needs a
key's values in memory.
"""

from __future__ import annotations

import itertools
import logging
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.coders.coder_impl import create_OutputStream
from apache_beam.transforms import trigger
from apache_beam.transforms import window
from apache_beam.utils import windowed_value

from beam_pyspark.planning.plan import GroupSpec
from beam_pyspark.worker.shuffle import paging
from beam_pyspark.worker.shuffle import panes
from beam_pyspark.worker.elements import CHUNK_BYTES
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.shuffle import ExternalGrouper
from beam_pyspark.worker.shuffle import unpack_records

_LOGGER = logging.getLogger(__name__)

_ON_TIME_PANE = windowed_value.PaneInfo(
    is_first=True,
    is_last=True,
    timing=windowed_value.PaneInfoTiming.ON_TIME,
    index=0,
    nonspeculative_index=0)

DEFAULT_BUDGET_BYTES = 256 << 20
# A group's values up to this size travel inline with its element.
INLINE_BYTES = 4 << 20


def group_values(
    runtime: JobRuntime,
    spec: GroupSpec,
    chunks: Iterable[bytes],
    budget: int = DEFAULT_BUDGET_BYTES,
    paged: bool = False,
    inline_bytes: int = INLINE_BYTES,
    stats: Optional[dict] = None,
    attempt: int = -1,
    compact: bool = False) -> Iterator[bytes]:
  """``chunks``: shuffled record chunks of one reduce partition;
  ``attempt``: the task attempt that owns the spill and page files;
  ``compact``: the records are (key, value) of a global-window
  KV<bytes, bytes> (``shuffle.kv_value_records``), not whole elements."""
  grouper = ExternalGrouper(budget, paging.attempt_dir(attempt))
  grouper.add_all(unpack_records(chunks))
  stats = {} if stats is None else stats
  stats['spilled_bytes'] = grouper.spilled_bytes
  stats['runs'] = grouper.runs_written
  groups = grouper.groups()
  if compact:
    return _reported(spec, stats, _compact_groups(
        runtime, spec, groups, attempt,
        inline_bytes if paged else None, stats))
  if spec.default_windowing:
    return _reported(spec, stats, _global_window_groups(
        runtime, spec, groups, attempt,
        inline_bytes if paged else None, stats))
  in_impl = runtime.coder_impl(spec.input_coder_id)
  out_impl = runtime.coder_impl(spec.output_coder_id)
  windowing = runtime.windowing(spec.windowing_strategy_id, spec.opaque_windows)

  proto = runtime.components.windowing_strategies[spec.windowing_strategy_id]

  def windowed_outputs():
    driver = trigger.create_trigger_driver(windowing, is_batch=True)
    for _, elements in groups:
      key = None
      values = []
      for encoded in elements:
        # Records hold the runner-safe encoding, byte-identical to the SDK
        # coder's: keys and values decode as the runner sees them (opaque
        # bytes where it does not know their coder), windows as the SDK's
        # where Python knows their coder (planning.sdks.grouping_coders).
        wv = in_impl.decode_from_stream(create_InputStream(encoded), True)
        key = wv.value[0]
        values.append(wv.with_value(wv.value[1]))
      if values and spec.final_panes:  # Beam's model closes the windows
        yield from panes.key_panes(driver, windowing, proto, key, values)
      elif values:  # as Python's own runners do
        yield from driver.process_entire_key(key, values)

  return _reported(spec, stats, encode_stream(out_impl, windowed_outputs()))


def _reported(spec: GroupSpec, stats: dict, chunks: Iterator[bytes]):
  """``chunks``, then a log line if the grouping spilled or paged."""
  yield from chunks
  if stats.get('runs') or stats.get('paged_groups'):
    _LOGGER.info(
        'GroupByKey %r: spilled %.1f MiB of records to local disk in %d '
        'sorted run(s); %d group(s) reached the next stage in pages',
        spec.transform_name, stats.get('spilled_bytes', 0) / 2**20,
        stats.get('runs', 0), stats.get('paged_groups', 0))


def _global_window_groups(runtime, spec, groups, attempt, inline_bytes, stats):
  in_impl = runtime.coder_impl(spec.safe_input_coder_id)
  out_impl = runtime.coder_impl(spec.safe_output_coder_id)
  paged_impl = None
  if inline_bytes is not None:
    paged_impl = paging.paged_output_impl(
        runtime.coder(spec.safe_output_coder_id), attempt, inline_bytes)
  max_ts = window.GlobalWindow().max_timestamp()
  windowed = window.GlobalWindows.windowed_value
  decode = in_impl.decode_from_stream
  limit = inline_bytes if paged_impl is not None else None
  out = create_OutputStream()
  for _, elements in groups:
    key = None
    values = []
    size = 0
    impl = out_impl
    for encoded in elements:
      kv = decode(create_InputStream(encoded), True).value
      key = kv[0]
      value = kv[1]
      values.append(value)
      if limit is not None:
        size += len(value) if type(value) is bytes else 64
        if size > limit:
          tail = (decode(create_InputStream(e), True).value[1] for e in elements)
          values = itertools.chain(values, tail)
          impl = paged_impl
          if stats is not None:
            stats['paged_groups'] = stats.get('paged_groups', 0) + 1
          break
    if key is None:
      continue
    impl.encode_to_stream(
        windowed((key, values), timestamp=max_ts, pane_info=_ON_TIME_PANE),
        out, True)
    if out.size() >= CHUNK_BYTES:
      yield out.get()
      out = create_OutputStream()
  if out.size():
    yield out.get()


def _compact_groups(runtime, spec, groups, attempt, inline_bytes, stats):
  """Grouped output written from the records' bytes, nothing decoded.

  Each output element is the global window's on-time pane header, the key,
  then the values' nested encodings as an iterable: counted when the group
  is small; else the state-backed form, the first ``inline_bytes`` inline
  and the rest behind a page token (see IterableCoderImpl.encode_to_stream
  for the layout, which the harness decodes).
  """
  out_impl = runtime.coder_impl(spec.safe_output_coder_id)
  empty = out_impl.encode_nested(window.GlobalWindows.windowed_value(
      (b'', []), timestamp=window.GlobalWindow().max_timestamp(),
      pane_info=_ON_TIME_PANE))
  # The empty key (varint 0) and the empty iterable (int32 0) end it.
  assert empty.endswith(b'\x00' * 5), empty
  header = empty[:-5]
  limit = inline_bytes
  out = create_OutputStream()
  for key, values in groups:
    out.write(header)
    out.write_var_int64(len(key))
    out.write(key)
    if limit is None:
      inline = list(values)
      out.write_bigendian_int32(len(inline))
      out.write(b''.join(inline))
    else:
      inline = []
      size = 0
      paged = False
      for value in values:
        inline.append(value)
        size += len(value)
        if size > limit:
          paged = True
          break
      if not paged:
        out.write_bigendian_int32(len(inline))
        out.write(b''.join(inline))
      else:
        token = paging.write_raw_pages(values, attempt)
        out.write_bigendian_int32(-1)
        out.write_var_int64(len(inline))
        out.write(b''.join(inline))
        out.write_var_int64(-1)
        out.write_var_int64(len(token))
        out.write(token)
        stats['paged_groups'] = stats.get('paged_groups', 0) + 1
    if out.size() >= CHUNK_BYTES:
      yield out.get()
      out = create_OutputStream()
  if out.size():
    yield out.get()
