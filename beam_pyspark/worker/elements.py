"""Encoded-element helpers: split chunks, extract keys, pack chunks."""

from __future__ import annotations

from typing import Iterable
from typing import Iterator

from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.coders.coder_impl import create_OutputStream

# Chunks handed to Spark are about this size: large enough that per-record
# costs vanish, small enough to stream.
CHUNK_BYTES = 1 << 20


def decode_all(coder_impl, chunks: Iterable[bytes]) -> Iterator:
  for data in chunks:
    stream = create_InputStream(data)
    while stream.size() > 0:
      yield coder_impl.decode_from_stream(stream, True)


def split_elements(coder_impl, chunks: Iterable[bytes]) -> Iterator[bytes]:
  """One encoded (nested) element per item, byte-identical for stable coders."""
  for value in decode_all(coder_impl, chunks):
    yield coder_impl.encode_nested(value)


def keyed_elements(
    wv_coder_impl, key_coder_impl,
    chunks: Iterable[bytes]) -> Iterator[tuple[bytes, bytes]]:
  """(encoded key, encoded windowed element) for windowed KV elements.

  The coders are the runner-safe ones, so a length-prefixed user key stays
  opaque bytes and grouping never runs user code.
  """
  for wv in decode_all(wv_coder_impl, chunks):
    yield key_coder_impl.encode_nested(wv.value[0]), wv_coder_impl.encode_nested(wv)


def pack(encoded: Iterable[bytes], limit: int = CHUNK_BYTES) -> Iterator[bytes]:
  """Concatenate encoded elements into chunks of about ``limit`` bytes."""
  parts: list[bytes] = []
  size = 0
  for e in encoded:
    parts.append(e)
    size += len(e)
    if size >= limit:
      yield b''.join(parts)
      parts, size = [], 0
  if parts:
    yield b''.join(parts)


def encode_stream(coder_impl, values: Iterable, limit: int = CHUNK_BYTES) -> Iterator[bytes]:
  out = create_OutputStream()
  for v in values:
    coder_impl.encode_to_stream(v, out, True)
    if out.size() >= limit:
      yield out.get()
      out = create_OutputStream()
  if out.size():
    yield out.get()
