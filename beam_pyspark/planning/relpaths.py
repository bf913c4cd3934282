"""File inputs and outputs a pipeline names by a relative path.

A task resolves a relative path against its own working directory. Over
Spark Connect that is the server's session directory (and on a cluster an
executor's work directory), not the directory of the program that named
it: ``--output out/counts`` was written into
``/tmp/spark-*/userFiles-*/out/counts``, the job ended DONE and the
program's ``out/`` stayed empty. Such a pipeline is refused before it runs.
An input likewise: Beam's ``ReadFromText('data/in.txt')`` checks the
pattern in the client's directory, then the server read its own
(``FileNotFoundError`` mid-job).

Beam's Python file sinks keep the path as given (Java's resolve it to an
absolute one when the pipeline is built), inside pickled DoFns: the
sinks' (``iobase.WriteImpl``'s ``FileBasedSink``: WriteToText, Avro,
Parquet, TFRecord) and fileio.WriteToFiles' DoFns' ``base_path``. Best
effort: a DoFn that cannot be unpickled here is not looked into.
"""

from __future__ import annotations

import os

from apache_beam.io.filebasedsink import FileBasedSink
from apache_beam.io.filebasedsource import FileBasedSource
from apache_beam.io.filesystems import FileSystems
from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2

_PAR_DO = common_urns.primitives.PAR_DO.urn
# fileio.WriteToFiles' last DoFn, moving its files into the directory the
# user named (the others write under a temporary directory inside it).
_FILEIO_FINAL = '_MoveTempFilesIntoFinalDestinationFn'
# A Python bounded read's first DoFn, emitting its source (iobase.Read).
_EMIT_SOURCE = '/Read/EmitSource'
# Where in a write's transform names the user's transform ends.
_INNER = ('/Write/WriteImpl/', '/ParDo(_')


def _pickled_dofns(pipeline: beam_runner_api_pb2.Pipeline):
  """(transform, fn, args, kwargs) of each ParDo of a pickled Python DoFn
  that unpickles here (a user's module not importable here is skipped:
  best effort), by name (a path named twice is reported once, by its
  first transform's name whatever the proto map's order)."""
  from apache_beam.internal import pickler
  transforms = pipeline.components.transforms
  for transform in sorted(transforms.values(), key=lambda t: t.unique_name):
    if transform.spec.urn != _PAR_DO:
      continue
    payload = beam_runner_api_pb2.ParDoPayload.FromString(
        transform.spec.payload)
    if payload.do_fn.urn != python_urns.PICKLED_DOFN_INFO:
      continue
    try:
      fn, args, kwargs = pickler.loads(payload.do_fn.payload)[:3]
    except Exception:  # pylint: disable=broad-except
      continue
    yield transform, fn, args, kwargs


def relative_outputs(pipeline: beam_runner_api_pb2.Pipeline
                     ) -> list[tuple[str, str]]:
  """(transform name, path) of each Python file output named by a
  relative local path, a path at most once."""
  found: dict[str, str] = {}
  for transform, fn, args, kwargs in _pickled_dofns(pipeline):
    for path in _paths(fn, list(args or ()) + list((kwargs or {}).values())):
      if _relative(path):
        found.setdefault(path, _outer(transform.unique_name))
  return [(name, path) for path, name in found.items()]


def relative_inputs(pipeline: beam_runner_api_pb2.Pipeline
                    ) -> list[tuple[str, str]]:
  """(transform name, pattern) of each Python file source (ReadFromText,
  Avro, Parquet, TFRecord: Beam's ``FileBasedSource``) named by a
  relative local path, a pattern at most once. Its ``Read`` transform is
  in the closure of the function of the read's EmitSource DoFn."""
  found: dict[str, str] = {}
  for transform, fn, _, _ in _pickled_dofns(pipeline):
    if not transform.unique_name.endswith(_EMIT_SOURCE):
      continue
    for source in _closed_over(getattr(fn, '_fn', None), FileBasedSource):
      pattern = _get(getattr(source, '_pattern', None))
      if isinstance(pattern, str) and pattern and _relative(pattern):
        found.setdefault(
            pattern, transform.unique_name[:-len(_EMIT_SOURCE)])
  return [(name, pattern) for pattern, name in found.items()]


def _closed_over(fn, kind, depth: int = 3) -> list:
  """The ``kind`` objects in ``fn``'s closure (and its functions')."""
  found = []
  for cell in getattr(fn, '__closure__', None) or ():
    try:
      value = cell.cell_contents
    except ValueError:  # an empty cell
      continue
    if isinstance(value, kind):
      found.append(value)
    elif isinstance(getattr(value, 'source', None), kind):  # iobase.Read
      found.append(value.source)
    elif callable(value) and depth > 1:
      found += _closed_over(value, kind, depth - 1)
  return found


def refusal(outputs: list[tuple[str, str]], where: str,
            inputs: tuple = ()) -> list[str]:
  """One reason a relative output or input is refused each; ``where``:
  where the tasks run (e.g. "over Spark Connect the tasks run in the
  server's session directory")."""
  return [
      f'{name} writes to {path!r}, a relative path: {where}, not in the '
      "directory of the program that named it, so the files would land "
      'there, out of sight. Give an absolute path (where the tasks share '
      "the program's file system) or a URL they can write (s3://, gs://, "
      'hdfs://).' for name, path in outputs] + [
          f'{name} reads {path!r}, a relative path: {where}, not in the '
          'directory of the program that named it, so they would read '
          'other files or none. Give an absolute path (where the tasks '
          "share the program's file system) or a URL they can read "
          '(s3://, gs://, hdfs://).' for name, path in inputs]


def _paths(fn, args) -> list[str]:
  paths = []
  candidates = list(args) + list(getattr(fn, '__dict__', {}).values())
  for value in candidates:
    if isinstance(value, FileBasedSink):
      paths.append(_get(value.file_path_prefix))
  if type(fn).__name__ == _FILEIO_FINAL:
    paths.append(_get(getattr(fn, 'path', None)))
  return [p for p in paths if isinstance(p, str) and p]


def _get(value):
  """A ValueProvider's value where it has one now, else ``value``."""
  if hasattr(value, 'is_accessible'):
    return value.get() if value.is_accessible() else None
  return value


def _outer(name: str) -> str:
  for inner in _INNER:
    if inner in name:
      return name[:name.index(inner)]
  return name


def _relative(path: str) -> bool:
  return FileSystems.get_scheme(path) is None and not os.path.isabs(path)
