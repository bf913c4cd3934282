"""ReadFromText's records of a split, read with Python's own line reading.

Beam's text source finds each record's end with its own buffer and a
restriction tracker claim per line (``_TextSource.read_records``): about
1.6-1.8 us a line, ten times ``BufferedReader.readline``. For the plain
case (a local, uncompressed file read by ``ReadFromText`` with no header
handling, the default separators and no escape character) this reads the
same records with Python's own reading (whole blocks split at ``\n``, or
``readline``), by the same rules:

* a split that starts past 0 begins after the first ``\\n`` at or after
  its start - 1 (the line that straddles its start belongs to the split
  before);
* a record starts while its offset is below the split's stop;
* ``\\n`` ends a record, and so does ``\\r\\n`` (a lone ``\\r`` does not);
  with ``strip_trailing_newlines`` the separator is dropped;
* the last record may end at the end of the file without a separator; an
  empty one there is no record;
* each record is decoded with the source's coder (the default one, UTF-8,
  a block of lines at once).

Any other source returns None, and is read by its own ``read``.
"""

from __future__ import annotations

import io
import itertools
from typing import Iterator
from typing import Optional

from apache_beam.coders.coders import StrUtf8Coder
from apache_beam.io.filebasedsource import _SingleFileSource
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.range_trackers import OffsetRangeTracker
from apache_beam.io.textio import _TextSource


def plain_text_records(source, start, stop) -> Optional[Iterator]:
  """The records of ``source`` (a split) between ``start`` and ``stop``,
  or None if it is not a plain text file split."""
  if type(source) is not _SingleFileSource:  # pylint: disable=unidiomatic-typecheck
    return None
  text = source._file_based_source  # pylint: disable=protected-access
  if type(text) is not _TextSource:  # pylint: disable=unidiomatic-typecheck
    return None
  # pylint: disable=protected-access
  if (text._skip_header_lines or text._header_matcher or
      text._header_processor or text._delimiter is not None or
      text._escapechar is not None or not source._splittable):
    return None
  file_name = source._file_name
  compression = text._compression_type
  if compression == CompressionTypes.AUTO:
    compression = CompressionTypes.detect_compression_type(file_name)
  if compression != CompressionTypes.UNCOMPRESSED:
    return None
  tracker = source.get_range_tracker(start, stop)
  if type(tracker) is not OffsetRangeTracker:  # pylint: disable=unidiomatic-typecheck
    return None
  f = text.open_file(file_name)
  if not isinstance(f, io.BufferedReader):
    f.close()
    return None
  start, stop = tracker.start_position(), tracker.stop_position()
  strip = text._strip_trailing_newlines
  if type(text._coder) is StrUtf8Coder and strip:  # pylint: disable=unidiomatic-typecheck
    return itertools.chain.from_iterable(_utf8_blocks(f, start, stop))
  return _records(f, start, stop, text._coder.decode, strip)


# Bytes read at once by the block reader.
BLOCK_BYTES = 1 << 20


def _utf8_blocks(f, start: int, stop: int) -> Iterator[list]:
  """The records as lists of str, a block of the file at a time: the
  default coder and separators, decoded a block at once (a ``\\n`` byte is
  never inside a UTF-8 sequence). A block that does not decode is decoded
  a line at a time, so that the error is the one Beam's source raises."""
  with f:
    position = _first_record(f, start)
    if position is None:
      return
    tail = b''
    while position < stop:
      block = f.read(BLOCK_BYTES)
      if not block:
        if tail:
          yield [tail.decode('utf-8')]  # the last record, no separator
        return
      data = tail + block
      end = data.rfind(b'\n') + 1
      if not end:
        tail = data
        continue
      tail = data[end:]
      # Lines start at position and after each \n; those from stop on are
      # the next split's.
      if position + data.rfind(b'\n', 0, end - 1) + 1 >= stop:
        wanted = 1 + data.count(b'\n', 0, max(0, stop - position - 1))
        end = _nth_end(data, wanted)
        tail = b''
      yield _decode_lines(data, end)
      position += end
    # (A record starting at or after stop is the next split's.)


def _nth_end(data: bytes, n: int) -> int:
  """The offset just past the n-th \\n of data."""
  end = 0
  for _ in range(n):
    end = data.index(b'\n', end) + 1
  return end


def _decode_lines(data: bytes, end: int) -> list:
  try:
    text = data[:end].decode('utf-8')
  except UnicodeDecodeError:
    return [
        (line[:-1] if line[-1:] == b'\r' else line).decode('utf-8')
        for line in data[:end - 1].split(b'\n')]
  lines = text.split('\n')
  lines.pop()  # after the last \n
  if '\r' in text:
    lines = [line[:-1] if line[-1:] == '\r' else line for line in lines]
  return lines


def _first_record(f, start: int) -> Optional[int]:
  """Where the split's first record starts (the file positioned there),
  or None if it has none."""
  if start <= 0:
    return 0
  f.seek(start - 1)
  skipped = f.readline()
  if skipped[-1:] != b'\n':
    return None  # no separator after the split's start: no record of ours
  return start - 1 + len(skipped)


def _records(f, start: int, stop: int, decode, strip: bool) -> Iterator:
  with f:
    readline = f.readline
    position = _first_record(f, start)
    if position is None:
      return
    while position < stop:
      line = readline()
      if not line:
        return
      position += len(line)
      if line[-1:] != b'\n':
        yield decode(line)  # the last record, with no separator
        return
      if strip:
        line = line[:-2] if line[-2:-1] == b'\r' else line[:-1]
      yield decode(line)
