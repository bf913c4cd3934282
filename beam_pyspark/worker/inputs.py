"""A task's input, read so that its producer's failure cannot pass for its end.

A stage's input is an iterator over what the stage before it in the same
Spark task produces (an RDD's partitions are pipelined), so an exception
raised while reading it is that stage's failure: its harness lost, its
source failing. A generator that raised reads as exhausted from then on,
so whoever catches such an exception (to fall back, to retry) and reads
on sees a shorter input, and a job that should fail ends DONE with fewer
records (issue 39: a fast-path stage fed by a PROCESS harness that could
not boot handed the harness its kept records, none, and the job ended
DONE with 0 of 20 lines). ``Guarded`` raises such a failure as
``InputFailed``, which code that recovers from its own errors lets pass,
and raises it again on every later read.
"""

from __future__ import annotations

from typing import Iterable
from typing import Iterator
from typing import Optional


class InputFailed(Exception):
  """Reading the task's input raised ``cause``: the producer failed, not
  the reader. Nothing recovers from it; the task fails with ``cause``."""
  def __init__(self, cause: BaseException):
    super().__init__(f'{type(cause).__name__}: {cause}')
    self.cause = cause


class Guarded:
  """Iterates ``records`` once; a failure of theirs raises ``InputFailed``
  (every time they are read after it, too)."""
  def __init__(self, records: Iterable):
    self._records = iter(records)
    self.failed: Optional[BaseException] = None

  def __iter__(self) -> Iterator:
    return self

  def __next__(self):
    if self.failed is not None:
      raise InputFailed(self.failed) from self.failed
    try:
      return next(self._records)
    except StopIteration:
      raise
    except InputFailed as exn:  # (a reader of a reader of the input)
      self.failed = exn.cause
      raise
    except Exception as exn:
      self.failed = exn
      raise InputFailed(exn) from exn
