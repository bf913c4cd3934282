"""A large group's values, handed to the harness in pages over the state API.

When one key's values outgrow what a bundle should carry, the reduce side
writes the first part inline and the rest to a local file, and encodes the
iterable with Beam's state-backed form: a ``StateKey.Runner`` token in place
of the tail (``beam:coder:state_backed_iterable:v1``, as Beam's FnApiRunner
does with ``use_state_iterables``).  The harness then reads the tail page by
page through the task's state servicer (``worker.state``), and may iterate it
again: each read starts from the file.

Files belong to the Spark task attempt that wrote them: the stage consuming
the group runs in the same task (``spark.tasks.RunStage``), which releases
them when it ends; a Python worker drops what an earlier attempt left.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import uuid
from typing import Iterable
from typing import Optional

from apache_beam.coders import coder_impl
from apache_beam.coders import coders
from apache_beam.coders.coder_impl import create_InputStream

from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.elements import pack

PAGE_BYTES = 1 << 20
TOKEN_PREFIX = b'beam-pyspark/pages/'
_lock = threading.Lock()


@dataclasses.dataclass
class _Pages:
  path: str
  pages: list[tuple[int, int]]  # (offset, length), element-aligned
  attempt: int


_stores: dict[bytes, _Pages] = {}


def spill_root() -> str:
  """This Python worker's directory under Spark's local dirs."""
  local = os.environ.get('SPARK_LOCAL_DIRS', '').split(',')[0]
  return os.path.join(local or tempfile.gettempdir(),
                      f'beam-pyspark-{os.getpid()}')


def attempt_dir(attempt: int) -> str:
  return os.path.join(spill_root(), f'attempt-{attempt}')


def write_pages(values: Iterable, element_impl, attempt: int,
                directory: Optional[str] = None) -> bytes:
  """Writes ``values`` to a page file; returns its state token."""
  return _write_page_file(
      encode_stream(element_impl, values, PAGE_BYTES), attempt, directory)


def write_raw_pages(encoded: Iterable[bytes], attempt: int,
                    directory: Optional[str] = None) -> bytes:
  """Like ``write_pages`` for values already in their nested encoding."""
  return _write_page_file(pack(encoded, PAGE_BYTES), attempt, directory)


def _write_page_file(pages: Iterable[bytes], attempt: int,
                     directory: Optional[str]) -> bytes:
  """Writes element-aligned ``pages`` to one file; returns its token."""
  directory = directory or attempt_dir(attempt)
  os.makedirs(directory, exist_ok=True)
  fd, path = tempfile.mkstemp(prefix='pages-', dir=directory)
  index = []
  offset = 0
  with os.fdopen(fd, 'wb') as f:
    for page in pages:
      f.write(page)
      index.append((offset, len(page)))
      offset += len(page)
  return _register(path, index, attempt)


def _register(path: str, pages: list, attempt: int) -> bytes:
  token = TOKEN_PREFIX + uuid.uuid4().hex.encode('ascii')
  with _lock:
    _stores[token] = _Pages(path, pages, attempt)
  return token


def read_page(token: bytes, continuation: Optional[bytes]) -> tuple[bytes, Optional[bytes]]:
  """(page, continuation token of the next page or None)."""
  with _lock:
    store = _stores.get(token)
  if store is None:
    raise KeyError(
        f'No paged values for state token {token!r}: they belong to another '
        'task, or the task that wrote them has ended')
  index = int(continuation) if continuation else 0
  if index >= len(store.pages):
    return b'', None
  offset, length = store.pages[index]
  with open(store.path, 'rb') as f:
    f.seek(offset)
    data = f.read(length)
  more = index + 1 < len(store.pages)
  return data, (str(index + 1).encode('ascii') if more else None)


class PagedValues:
  """A group's values past its inline part, decoded from their pages as
  they are iterated, from the first page again on every iteration (as the
  harness's state-backed iterable re-reads them over the state API)."""
  def __init__(self, token: bytes, element_impl):
    self._token = token
    self._impl = element_impl

  def __iter__(self):
    decode = self._impl.decode_from_stream
    continuation = None
    while True:
      data, continuation = read_page(self._token, continuation)
      stream = create_InputStream(data)
      while stream.size() > 0:
        yield decode(stream, True)
      if not continuation:
        return

  def __reduce__(self):
    return list, (list(self), )


coder_impl.FastPrimitivesCoderImpl.register_iterable_like_type(PagedValues)


def read_paged_values(token: bytes, element_impl):
  """A PipelineContext's ``iterable_state_read``: a state-backed
  iterable's tail, where this Python worker holds its pages."""
  if not is_paged_token(token):
    raise ValueError(f'State token {token!r} names no pages of this runner')
  return PagedValues(token, element_impl)


def is_paged_token(token: bytes) -> bool:
  return token.startswith(TOKEN_PREFIX)


def release(attempt: Optional[int] = None, others: bool = False) -> None:
  """Drops the pages of ``attempt`` (or, with ``others``, of every other
  attempt: what a failed or killed earlier task of this worker left)."""
  with _lock:
    tokens = [
        t for t, s in _stores.items()
        if (s.attempt != attempt if others else s.attempt == attempt)]
    dropped = [_stores.pop(t) for t in tokens]
  for store in dropped:
    try:
      os.remove(store.path)
    except FileNotFoundError:
      pass
  root = spill_root()
  if others and os.path.isdir(root):
    keep = f'attempt-{attempt}'
    for name in os.listdir(root):
      if name != keep:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def paged_output_impl(coder, attempt: int, inline_bytes: int):
  """A coder impl for grouped output whose iterable spills to pages.

  ``coder``: the runner-safe WindowedValue<KV<K, Iterable<V>>> coder.  None
  when it has another shape: such output is then written inline.
  """
  if not isinstance(coder, coders.WindowedValueCoder):
    return None
  kv = coder.wrapped_value_coder
  if not isinstance(kv, coders.TupleCoder) or len(kv.coders()) != 2:
    return None
  key_coder, iterable_coder = kv.coders()
  if type(iterable_coder) is not coders.IterableCoder:
    return None

  def write_state(values, element_impl):
    return write_pages(values, element_impl, attempt)

  paged = coders.StateBackedIterableCoder(
      iterable_coder.value_coder(),
      write_state=write_state,
      write_state_threshold=inline_bytes)
  return coders.WindowedValueCoder(
      coders.TupleCoder([key_coder, paged]), coder.window_coder).get_impl()
