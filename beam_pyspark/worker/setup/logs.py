"""Log records written while a task runs user code, kept for the job.

An embedded harness logs into the Spark Python worker's own ``logging``; a
task captures what is logged while it runs (by the user's DoFns and by the
harness), bounded in count and size, and the driver forwards it to the
job's message stream. One task runs at a time in a PySpark worker process,
so attaching to the root logger for the task's duration attributes records
to the right task.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator
from typing import Mapping
from typing import Optional

# Loggers of the Spark plumbing around the task: not the job's business.
_IGNORED_PREFIXES = ('py4j', 'pyspark')

# The runner side of the Fn API, run by the task itself: its INFO lines
# (servers started, channels opened) are not the job's news.
_PLUMBING_PREFIXES = (
    'apache_beam.runners.portability', 'apache_beam.runners.worker.data_plane',
    'apache_beam.runners.worker.worker_pool_main',
    # "Creating state cache with size 0", once per harness.
    'apache_beam.runners.worker.statecache')

MAX_RECORDS_PER_TASK = 1000
MAX_BYTES_PER_TASK = 1 << 20


class _Capture(logging.Handler):
  def __init__(self, limit_records: int, limit_bytes: int):
    super().__init__(logging.NOTSET)
    self.records: list[tuple[float, int, str]] = []
    self.dropped = 0
    self._bytes = 0
    self._limit_records = limit_records
    self._limit_bytes = limit_bytes
    self.setFormatter(logging.Formatter())

  def emit(self, record: logging.LogRecord) -> None:
    if record.name.startswith(_IGNORED_PREFIXES):
      return
    if (record.levelno < logging.WARNING and
        record.name.startswith(_PLUMBING_PREFIXES)):
      return
    try:
      # The logger's name says where a line comes from; the root logger's
      # ('root') says nothing, and clients print their own level and name
      # in front ('INFO:root:root: ...').
      text = (record.getMessage() if record.name == 'root' else
              f'{record.name}: {record.getMessage()}')
      if record.exc_info:
        text += '\n' + self.formatter.formatException(record.exc_info)
    except Exception:  # pylint: disable=broad-except
      text = f'{record.name}: {record.msg!r} (unformattable log record)'
    if (len(self.records) >= self._limit_records or
        self._bytes + len(text) > self._limit_bytes):
      self.dropped += 1
      return
    self._bytes += len(text)
    self.records.append((record.created, record.levelno, text))

  def entries(self) -> list[tuple[float, int, str]]:
    if not self.dropped:
      return list(self.records)
    last = self.records[-1][0] if self.records else 0.0
    return self.records + [(
        last, logging.WARNING,
        f'beam_pyspark: {self.dropped} more log records of this task were '
        f'dropped (at most {self._limit_records} records or '
        f'{self._limit_bytes} bytes are kept per task)')]


@contextlib.contextmanager
def capture_logs(
    level: int = logging.INFO,
    overrides: Optional[Mapping[str, int]] = None,
    limit_records: int = MAX_RECORDS_PER_TASK,
    limit_bytes: int = MAX_BYTES_PER_TASK) -> Iterator[_Capture]:
  """Captures records at ``level`` and above (per-logger ``overrides``)."""
  root = logging.getLogger()
  handler = _Capture(limit_records, limit_bytes)
  saved = {'': root.level}
  root.setLevel(level)
  for name, lvl in (overrides or {}).items():
    saved[name] = logging.getLogger(name).level
    logging.getLogger(name).setLevel(lvl)
  root.addHandler(handler)
  try:
    yield handler
  finally:
    root.removeHandler(handler)
    for name, lvl in saved.items():
      logging.getLogger(name or None).setLevel(lvl)
