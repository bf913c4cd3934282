"""Shared helpers of the semantics tests.

The tests run pipelines on ``beam_pyspark.PySparkRunner`` (local[2]) and,
to know what to expect independently of our runner, on Beam's FnApiRunner.
Results are collected in the test process through files: Spark executors
are separate Python processes, so a DoFn cannot append to a list of ours.

A single SparkContext is reused by every test of the process (the runner
reuses the active context); it is never stopped here.
"""

from __future__ import annotations

import itertools
import os
import pickle
import uuid

# Tests fork (Spark's JVM launcher) while gRPC servers of other tests run;
# gRPC's fork handlers then break the child now and then. Beam's own
# subprocess tests turn them off the same way. Read when grpc is imported.
os.environ.setdefault('GRPC_ENABLE_FORK_SUPPORT', 'false')
# botocore asks the cloud's instance metadata service for credentials it
# finds nowhere else: tests reach only loopback (moto's S3 server, with
# credentials given), never that address. Inherited by servers and jobs.
os.environ.setdefault('AWS_EC2_METADATA_DISABLED', 'true')

import pytest  # pylint: disable=wrong-import-position

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.transforms import window as beam_window

SPARK_RUNNER = 'beam_pyspark.PySparkRunner'
SPARK_MASTER = 'local[2]'


def spark_options(**extra) -> PipelineOptions:
  """Options running on our runner; ``extra`` become ``--key=value`` flags."""
  flags = [f'--runner={SPARK_RUNNER}', f'--spark_master_url={SPARK_MASTER}']
  for key, value in extra.items():
    if isinstance(value, (list, tuple)):
      flags.extend(f'--{key}={v}' for v in value)
    elif value is True:
      flags.append(f'--{key}')
    else:
      flags.append(f'--{key}={value}')
  return PipelineOptions(flags)


def window_key(w):
  """A plain, comparable description of a window."""
  if isinstance(w, beam_window.GlobalWindow):
    return ('global', )
  if isinstance(w, beam_window.IntervalWindow):
    return ('interval', w.start.micros, w.end.micros)
  return (type(w).__name__, repr(w), w.max_timestamp().micros)


def pane_key(pane):
  return (pane.is_first, pane.is_last, int(pane.timing), pane.index,
          pane.nonspeculative_index)


def normalize(value):
  """Iterables (e.g. GroupByKey's values) into sorted lists, recursively."""
  if isinstance(value, (str, bytes, int, float, bool, type(None))):
    return value
  if isinstance(value, tuple):
    return tuple(normalize(v) for v in value)
  if isinstance(value, dict):
    return {k: normalize(v) for k, v in value.items()}
  if isinstance(value, (set, frozenset)):
    return sorted(normalize(v) for v in value)
  try:
    items = [normalize(v) for v in value]
  except TypeError:
    return value
  return sort_all(items)


class Observe(beam.DoFn):
  """element -> (normalized element, timestamp in micros, window)."""
  def process(
      self,
      element,
      timestamp=beam.DoFn.TimestampParam,
      w=beam.DoFn.WindowParam):
    yield (normalize(element), timestamp.micros, window_key(w))


class ObservePane(beam.DoFn):
  """element -> (normalized element, timestamp, window, pane)."""
  def process(
      self,
      element,
      timestamp=beam.DoFn.TimestampParam,
      w=beam.DoFn.WindowParam,
      pane=beam.DoFn.PaneInfoParam):
    yield (normalize(element), timestamp.micros, window_key(w), pane_key(pane))


class WriteToDir(beam.DoFn):
  """Pickles each bundle's elements into a new file of ``directory``."""
  def __init__(self, directory: str):
    self.directory = directory

  def start_bundle(self):
    self._buffer = []

  def process(self, element):
    self._buffer.append(element)

  def finish_bundle(self):
    if self._buffer:
      path = os.path.join(self.directory, uuid.uuid4().hex + '.pkl')
      with open(path + '.tmp', 'wb') as f:
        pickle.dump(self._buffer, f)
      os.rename(path + '.tmp', path)
      self._buffer = []


def read_dir(directory: str) -> list:
  out = []
  for name in sorted(os.listdir(directory)):
    if name.endswith('.pkl'):
      with open(os.path.join(directory, name), 'rb') as f:
        out.extend(pickle.load(f))
  return out


def sort_all(values) -> list:
  """Sorted naturally if the values compare, else by their repr."""
  values = list(values)
  try:
    return sorted(values)
  except TypeError:
    return sorted(values, key=repr)


class Collector:
  """Runs a pipeline and returns what its collected PCollection held."""
  def __init__(self, base_dir):
    self.base_dir = base_dir
    self._ids = itertools.count()

  def run(self, build, runner=None, options=None) -> list:
    """``build(pipeline) -> PCollection``; returns its elements, sorted."""
    out = os.path.join(str(self.base_dir), f'out{next(self._ids)}')
    os.makedirs(out)
    p = beam.Pipeline(runner=runner, options=options)
    pcoll = build(p)
    _ = pcoll | 'CollectForTest' >> beam.ParDo(WriteToDir(out))
    result = p.run()
    result.wait_until_finish()
    return sort_all(read_dir(out))

  def spark(self, build, **extra) -> list:
    return self.run(build, options=spark_options(**extra))

  def reference(self, build) -> list:
    """The same pipeline on Beam's FnApiRunner."""
    return self.run(build, runner=FnApiRunner(), options=PipelineOptions())

  def both(self, build, **extra) -> tuple[list, list]:
    """(our runner's output, FnApiRunner's output), each sorted."""
    return self.spark(build, **extra), self.reference(build)


@pytest.fixture
def collect(tmp_path) -> Collector:
  return Collector(tmp_path)


class _KeepRecords:
  """A logging handler that keeps (level, message) of what it sees."""
  def __init__(self):
    import logging

    class Handler(logging.Handler):
      def emit(inner, record):  # pylint: disable=no-self-argument
        self.seen.append((record.levelno, record.getMessage()))

    self.seen = []
    self.handler = Handler()


@pytest.fixture
def client_log():
  """What PySparkRunner's client log (``beam_pyspark.runner``) receives:
  the job's messages, executors' log lines among them. ``.seen`` is a list
  of (level, message)."""
  import logging
  keep = _KeepRecords()
  logger = logging.getLogger('beam_pyspark.runner')
  saved = logger.level
  logger.addHandler(keep.handler)
  logger.setLevel(logging.INFO)
  try:
    yield keep
  finally:
    logger.removeHandler(keep.handler)
    logger.setLevel(saved)


# -- the order of scopes: longest first ----------------------------------------
#
# `make test` runs three pytest-xdist workers with --dist=loadscope (a test
# class, or a module's test functions, to one worker at a time) and
# --no-loadscope-reorder, so the scopes go out in the order collected here:
# longest first, by the seconds of a whole run (tests/scope_durations.json,
# made by scripts/scope-durations.py). pytest-xdist's own reorder puts the
# scopes with the most tests first, and so the Java ValidatesRunner suite
# (one pytest test of ~10 minutes) last, alone at the end while the other
# workers idle (the file: a clean-clone run with two workers on
# 2026-11-29, load 5-9. Only the order matters). A scope not in the file counts as a minute; tests keep
# their order within a scope. In one process (no xdist) the order is
# pytest's, so module fixtures are set up once.
_DURATIONS = os.path.join(os.path.dirname(__file__), 'scope_durations.json')
_UNKNOWN_SCOPE_SECS = 60


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  import json  # pylint: disable=import-outside-toplevel
  if not os.environ.get('PYTEST_XDIST_WORKER'):
    return
  try:
    with open(_DURATIONS, encoding='utf-8') as f:
      seconds = json.load(f)
  except (OSError, ValueError):
    return
  def scope(item):  # as pytest-xdist's LoadScopeScheduling._split_scope
    return item.nodeid.rsplit('::', 1)[0]
  items.sort(key=lambda item: -seconds.get(scope(item), _UNKNOWN_SCOPE_SECS))


def pytest_unconfigure(config):
  """The failed tests' names once more, as the very last lines: CI shows
  the end of a long output, and pytest's summary of failures comes before
  its list of skips and the final count."""
  reporter = config.pluginmanager.get_plugin('terminalreporter')
  if reporter is None:
    return
  failed = [r.nodeid for kind in ('failed', 'error')
            for r in reporter.stats.get(kind, [])]
  if failed:
    reporter.write_sep('=', f'{len(set(failed))} failed or in error')
    for nodeid in dict.fromkeys(failed):
      reporter.write_line(f'FAILED {nodeid}')
