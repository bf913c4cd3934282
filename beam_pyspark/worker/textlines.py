"""ReadFromText's records of a split, read with Python's own line reading.

Beam's text source finds each record's end with its own buffer and a
restriction tracker claim per line (``_TextSource.read_records``): about
1.6-1.8 us a line, ten times ``BufferedReader.readline``. For the plain
case (a local, uncompressed file read by ``ReadFromText`` with no header
handling, the default separators and no escape character) this reads the
same records with ``readline``, by the same rules:

* a split that starts past 0 begins after the first ``\\n`` at or after
  its start - 1 (the line that straddles its start belongs to the split
  before);
* a record starts while its offset is below the split's stop;
* ``\\n`` ends a record, and so does ``\\r\\n`` (a lone ``\\r`` does not);
  with ``strip_trailing_newlines`` the separator is dropped;
* the last record may end at the end of the file without a separator; an
  empty one there is no record;
* each record is decoded with the source's coder.

Any other source returns None, and is read by its own ``read``.
"""

from __future__ import annotations

import io
from typing import Iterator
from typing import Optional

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
  return _records(f, tracker.start_position(), tracker.stop_position(),
                  text._coder.decode, text._strip_trailing_newlines)


def _records(f, start: int, stop: int, decode, strip: bool) -> Iterator:
  with f:
    readline = f.readline
    if start > 0:
      f.seek(start - 1)
      skipped = readline()
      if skipped[-1:] != b'\n':
        return  # no separator after the split's start: no record of ours
      position = start - 1 + len(skipped)
    else:
      position = 0
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
