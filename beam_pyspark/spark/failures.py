"""What a Spark job's failure means to a user, and memory it may use.

The Python part of a failed Spark job's error is the user's traceback;
a failure that looks like memory names the caps it ran under.
"""

from __future__ import annotations

import re
from typing import Optional

from beam_pyspark.errors import PipelineExecutionError
# Its errors are among those a failed task's traceback ends with.
from beam_pyspark.worker import harnesses as _harnesses  # pylint: disable=unused-import


def group_budget(sc, group_memory_mb: Optional[int] = None) -> int:
  """Bytes a reduce task groups in memory before spilling sorted runs.

  ``--group_memory_mb``, else half of ``spark.python.worker.memory``
  (PySpark's own spill point for its Python-side aggregation, default
  512m): the rest is the worker's Beam, its harness and the bundle in
  flight.
  """
  if group_memory_mb is not None:
    return max(1, int(group_memory_mb)) << 20
  from pyspark.core.rdd import _parse_memory  # MiB
  # The context's own conf (one py4j call), not getConf()'s copy (a call a
  # setting: ~90 at every job's start).
  conf = sc._conf.get('spark.python.worker.memory', '512m')  # pylint: disable=protected-access
  return max(16, _parse_memory(conf) // 2) << 20


_MEMORY_SIGNS = ('MemoryError', 'Python worker exited unexpectedly',
                 'java.lang.OutOfMemoryError', 'Cannot allocate memory')


def memory_hint(error: str, conf) -> str:
  """For a failure that looks like memory: the caps it ran under."""
  if not any(sign in error for sign in _MEMORY_SIGNS):
    return ''
  settings = []
  for key in ('spark.executor.pyspark.memory', 'spark.python.worker.memory',
              'spark.executor.memory', 'spark.driver.memory'):
    value = conf.get(key, None)
    if value:
      settings.append(f'{key}={value}')
  caps = ', '.join(settings) or 'no explicit memory settings'
  return (
      'This looks like a worker running out of memory (a Python worker '
      f'that crashes is often killed at its memory cap). Ran with {caps}. '
      'Raise spark.executor.pyspark.memory (the Python worker cap) or '
      'spark.executor.memory, or use more, smaller partitions '
      '(--spark_parallelism); a DoFn that builds large in-memory '
      'collections per element needs room for them.')


def spark_failure_message(exn: BaseException) -> str:
  """The Python part of a failed Spark job's error: the user's traceback."""
  text = str(exn)
  start = text.find('Traceback (most recent call last)')
  if start < 0:
    return text
  end = text.find('\n\tat ', start)
  python_part = text[start:end if end > 0 else len(text)].rstrip()
  # Spark's error class adds its SQL state after the Python traceback.
  python_part = re.sub(r'\s*SQLSTATE: \w+$', '', python_part).rstrip()
  # A failure inside a stage: what follows the marker is the harness's error,
  # which names the failing step and holds the user's traceback (or, of a
  # harness that went away, its last words); PySpark's own frames before it
  # are noise.
  found = max(((python_part.rfind(marker), marker) for marker in _markers()),
              default=(-1, ''))
  if found[0] >= 0:
    return python_part[found[0] + len(found[1]):]
  return python_part


def _markers() -> list[str]:
  """How a traceback names PipelineExecutionError and its subclasses
  (``worker.harnesses.HarnessLostError``: a harness gone, whose message
  is the first line the job's failure should show)."""
  classes, todo = [], [PipelineExecutionError]
  while todo:
    cls = todo.pop()
    classes.append(cls)
    todo.extend(cls.__subclasses__())
  return [f'{cls.__module__}.{cls.__qualname__}: ' for cls in classes]
