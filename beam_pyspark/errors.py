"""Errors a user of the runner or the job server can act on."""

from __future__ import annotations

import builtins
import importlib
import re
from typing import Optional


class BeamPySparkError(Exception):
  """Base class of the runner's own errors."""


class UnsupportedPipelineError(BeamPySparkError, ValueError):
  """The pipeline uses features this runner cannot execute.

  Raised before anything runs; lists every unsupported item at once.
  """
  def __init__(self, reasons: list[str]):
    self.reasons = list(reasons)
    super().__init__(
        'This pipeline cannot run on beam-pyspark:\n' +
        '\n'.join(f'  - {r}' for r in self.reasons) +
        '\nChange or remove these parts of the pipeline and submit again.')


class InvalidOptionsError(BeamPySparkError, ValueError):
  """Pipeline options the runner cannot take; lists every problem at once."""
  def __init__(self, problems: list[str]):
    self.problems = list(problems)
    super().__init__(
        'Invalid pipeline options for beam-pyspark:\n' +
        '\n'.join(f'  - {p}' for p in self.problems))


class PipelineExecutionError(BeamPySparkError, RuntimeError):
  """The pipeline failed while running; carries the user's traceback."""


class JobCancelledError(BeamPySparkError):
  """The job was cancelled while running."""


# Definite signs of memory running out, and where: (pattern, what ran out).
_OUT_OF_MEMORY = (
    (re.compile(r'java\.lang\.OutOfMemoryError\b[^\n]*'),
     'a JVM of Spark (the driver\'s or an executor\'s): raise '
     'spark.driver.memory or spark.executor.memory'),
    (re.compile(r'^(?:[\w.]+\.)?MemoryError\b[^\n]*', re.MULTILINE),
     'a Python process: the driver\'s, or an executor\'s Python worker '
     '(spark.executor.pyspark.memory caps those)'),
    (re.compile(r'[^\n]*(?:exceeding memory limits|OOMKilled)[^\n]*'),
     'a container killed at its memory limit: raise '
     'spark.executor.memoryOverhead'),
    (re.compile(r'[^\n]*Cannot allocate memory[^\n]*'),
     'the host (the kernel refused memory)'),
)


def out_of_memory(error: str) -> Optional[str]:
  """A first line for a job's error caused by memory running out, naming
  the sign and where; None for any other error. The sign is often deep in
  a py4j or Spark traceback (a JVM's OutOfMemoryError inside a
  Py4JJavaError), where nobody reads."""
  for pattern, where in _OUT_OF_MEMORY:
    match = pattern.search(error)
    if match:
      sign = match.group(0).strip()[:300]
      return f'Out of memory: {sign} (in {where}).'
  return None


_TRACEBACK = 'Traceback (most recent call last)'
# The last line of a formatted traceback: 'pkg.mod.Name: message' or 'Name'.
_EXCEPTION_LINE = re.compile(r'^(?P<name>[A-Za-z_][\w.]*)(?:: (?P<message>.*))?$')


def user_exception(error: str, details: str = '') -> Optional[BaseException]:
  """The user's exception, rebuilt from a failed job's error text.

  A DoFn's exception reaches the driver as text (the harness formats it,
  and Spark carries it from the executor), so the type is read from the
  traceback's last line, as Beam's runners name it: ``ValueError: bad
  element [while running 'Step']``. What comes back is an instance of a
  subclass of both that type and PipelineExecutionError, so ``except
  ValueError`` and ``except PipelineExecutionError`` both catch it, as they
  would with Beam's DirectRunner and with this runner before. None when
  the text holds no traceback, or the type cannot be imported or built
  from a message. ``details`` (the traceback from the executor) follows
  the message, so the exception's text holds everything once.
  """
  start = error.rfind(_TRACEBACK)
  if start < 0:
    return None
  lines = error[start:].splitlines()
  for i in range(len(lines) - 1, 0, -1):
    line = lines[i]
    if not line or line[0].isspace():
      continue
    match = _EXCEPTION_LINE.match(line)
    if match is None:
      continue
    message = '\n'.join(
        [match.group('message') or ''] + lines[i + 1:]).strip()
    cls = _exception_class(match.group('name'))
    if cls is None:
      return None
    return _as_pipeline_error(
        cls, f'{message}\n\n{details}' if details else message)
  return None


def _exception_class(name: str) -> Optional[type]:
  module_name, _, attr = name.rpartition('.')
  try:
    if not module_name:
      cls = getattr(builtins, attr)
    else:
      cls = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError, ValueError):
    return None
  if not (isinstance(cls, type) and issubclass(cls, Exception)):
    return None
  return cls


def _as_pipeline_error(cls: type, message: str) -> Optional[BaseException]:
  if issubclass(cls, PipelineExecutionError):
    return cls(message)
  try:
    both = type(cls.__name__, (cls, PipelineExecutionError), {
        '__module__': cls.__module__,
        '__qualname__': cls.__qualname__,
        '__doc__': cls.__doc__,
    })
    return both(message)
  except Exception:  # pylint: disable=broad-except
    # Layouts that cannot be combined (some C types), or a constructor
    # that does not take one message: keep the job's own error.
    return None


# Lines of a JVM's dump that say nothing of why a job failed: a streaming
# query's state ("Thread State: RUNNABLE"), stack frames, plan headers.
_DUMP_LINE = re.compile(
    r'^(?:Thread State:|Current State:|Current \w+ Offsets?:|=== .* ===$|'
    r'at [\w$.<>]+\(|\.\.\. \d+ more$|Caused by: \S+$|[-=]{3,}$|'
    r'During handling of the above exception|'
    r'The above exception was the direct cause)')
_QUERY_TERMINATED = re.compile(
    r'terminated with exception: (?P<cause>.*?)(?:\s*SQLSTATE: \w+)?$')
MAX_ROOT_CAUSE_CHARS = 300


def root_cause(error: str) -> str:
  """One line saying why a job failed, for summaries (the status page,
  the job's log line): the error's first line, or, where that is a
  traceback's header, the exception the traceback ends in (the user's or
  Beam's, e.g. "ValueError: boom [while running 'Parse']"); never a line
  of a JVM's dump ("Thread State: RUNNABLE"), which a failed streaming
  query's text ends in."""
  lines = [line.rstrip() for line in (error or '').splitlines()]
  chosen = ''
  in_traceback = False
  for line in lines:
    text = line.strip()
    if not text:
      continue
    if text.startswith(_TRACEBACK):
      in_traceback = True
      continue
    if in_traceback:
      if line[:1].isspace() or _DUMP_LINE.match(text):
        continue  # a frame, its source line, or a caret line
      chosen = text
      break
    if _DUMP_LINE.match(text):
      continue
    chosen = text
    break
  if not chosen:
    chosen = next((line.strip() for line in lines if line.strip()), '')
  found = _QUERY_TERMINATED.search(chosen)
  if found:
    chosen = found.group('cause')
  if len(chosen) > MAX_ROOT_CAUSE_CHARS:
    chosen = chosen[:MAX_ROOT_CAUSE_CHARS - 1] + '\u2026'
  return chosen
