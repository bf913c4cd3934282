"""The fast path on Spark (local[2]), on and off: a DoFn's lifecycle per
Python worker, and a pipeline of the shapes people write (a DoFn of their
own, Filter, Partition, keyed transforms, timestamps and fixed windows,
CoGroupByKey, metrics), with identical output, element counts and
metrics either way."""

from __future__ import annotations

import glob
import os
import re
import time

import apache_beam as beam
import pytest
from apache_beam.io import ReadFromText
from apache_beam.metrics import Metrics
from apache_beam.transforms import window
from apache_beam.utils.windowed_value import WindowedValue

from conftest import spark_options
from fast_stages import run_on_and_off


def _lines(path, n):
  with open(path, 'w', encoding='utf-8') as f:
    for i in range(n):
      f.write(' '.join(f'w{(i * 7 + j) % 500}' for j in range(i % 11)) + '\n')
  return str(path)


@pytest.fixture(scope='module')
def text(tmp_path_factory):
  """About 2.4 MiB of lines (three splits in two tasks, so two bundles)."""
  return _lines(tmp_path_factory.mktemp('life') / 'lines.txt', 100_000)


@pytest.fixture(scope='module')
def small_text(tmp_path_factory):
  """A tenth of ``text``: the shapes need no more than a bundle, and with
  the fast path off each of their dozen steps runs in the harness (the
  test took 89 s with ``text`` at load 9)."""
  return _lines(tmp_path_factory.mktemp('shapes') / 'lines.txt', 10_000)


class Life(beam.DoFn):
  """Logs its lifecycle to a file per instance; outputs its bundle's line
  count at the bundle's end; its teardown fails (a job's end does not)."""
  def __init__(self, log_dir):
    self.log_dir = log_dir

  def _log(self, event):
    name = os.path.join(self.log_dir, f'{os.getpid()}-{id(self)}')
    with open(name, 'a', encoding='utf-8') as f:
      f.write(event + '\n')

  def setup(self):
    self._log('setup')

  def start_bundle(self):
    self._log('start')
    self.lines = 0

  def process(self, line):
    self.lines += 1
    return line.split()

  def finish_bundle(self):
    self._log('finish')
    yield WindowedValue('#lines', window.GlobalWindow().max_timestamp(),
                        [window.GlobalWindow()])
    for _ in range(self.lines - 1):
      yield WindowedValue('#lines', window.GlobalWindow().max_timestamp(),
                          [window.GlobalWindow()])

  def teardown(self):
    self._log('teardown')
    raise RuntimeError('teardown failed (logged, not the job\'s failure)')


def _lifecycles(log_dir, timeout=60.0):
  """Each instance's events, once every instance is torn down (the job's
  harnesses are released after it ends, from a thread)."""
  deadline = time.monotonic() + timeout
  while True:
    logs = {}
    for name in glob.glob(os.path.join(log_dir, '*')):
      with open(name, encoding='utf-8') as f:
        logs[os.path.basename(name)] = f.read().split()
    if logs and all(events[-1] == 'teardown' for events in logs.values()):
      return logs
    if time.monotonic() > deadline:
      return logs
    time.sleep(0.2)


def test_lifecycle_per_worker_and_bundle_on_and_off(text, tmp_path):
  logs = {}

  def build(p, out):
    log_dir = tmp_path / f'life{len(logs)}'
    log_dir.mkdir()
    logs[len(logs)] = str(log_dir)
    _ = (p | ReadFromText(text) | 'Life' >> beam.ParDo(Life(str(log_dir)))
         | beam.combiners.Count.PerElement()
         | beam.MapTuple(lambda word, n: f'{word} {n}')
         | beam.io.WriteToText(out))

  (on, _, _, messages), (off, _, _, _) = run_on_and_off(build, tmp_path)
  assert on == off and '#lines 100000' in on
  assert any('Life' in m for m in messages if 'on the fast path' in m)
  starts = []
  for run in (0, 1):
    lifecycles = _lifecycles(logs[run])
    assert lifecycles
    for events in lifecycles.values():
      # setup once per instance; bundles in between; teardown at the end.
      assert events[0] == 'setup' and events[-1] == 'teardown', events
      assert events[1:-1] == ['start', 'finish'] * ((len(events) - 2) // 2)
    starts.append(sum(e.count('start') for e in lifecycles.values()))
  assert starts[0] == starts[1] >= 2


class Stamp(beam.DoFn):
  """Timestamps words by their number, counting them and its bundles."""
  def __init__(self):
    self.words = Metrics.counter('shapes', 'words')
    self.bundles = Metrics.distribution('shapes', 'bundles')

  def start_bundle(self):
    self.bundles.update(1)

  def process(self, word):
    self.words.inc()
    yield window.TimestampedValue(word, int(word[1:]))


class WordExtractingDoFn(beam.DoFn):
  def process(self, element):
    return re.findall(r'[\w\']+', element, re.UNICODE)


def test_the_shapes_people_write_on_and_off(small_text, tmp_path):
  def build(p, out):
    words = (p | ReadFromText(small_text) | 'Split' >> beam.ParDo(WordExtractingDoFn())
             | 'NotW1' >> beam.Filter(lambda w: not w.startswith('w1')))
    short, long_ = words | beam.Partition(lambda w, n: int(len(w) > 3), 2)
    counted = (short | beam.Map(lambda w: (w, 1))
               | 'CountShort' >> beam.CombinePerKey(sum)
               | 'FormatShort' >> beam.MapTuple(lambda k, v: f'short {k} {v}'))
    keyed = long_ | beam.WithKeys(len) | beam.KvSwap() | beam.Values()
    lengths = (keyed | 'Lengths' >> beam.Map(lambda n: (n % 3, n))
               | 'SumLengths' >> beam.CombinePerKey(sum))
    others = words | 'Others' >> beam.Map(lambda w: (len(w) % 3, w))
    joined = ({'lengths': lengths, 'words': others} | beam.CoGroupByKey()
              | beam.MapTuple(lambda k, v: f'cogbk {k} {sorted(v["lengths"])} '
                              f'{len(v["words"])}'))

    class InWindow(beam.DoFn):
      def process(self, kv, w=beam.DoFn.WindowParam):
        yield f'window {w.start} {kv[0]} {kv[1]}'

    windowed = (words | beam.ParDo(Stamp())
                | beam.WindowInto(window.FixedWindows(100))
                | beam.Map(lambda w: (w[:2], 1))
                | 'CountInWindow' >> beam.CombinePerKey(sum)
                | beam.ParDo(InWindow())
                | 'Global' >> beam.WindowInto(window.GlobalWindows()))
    _ = ((counted, joined, windowed) | beam.Flatten()
         | beam.io.WriteToText(out))

  (on, on_counts, on_user, messages), (off, off_counts, off_user, _) = (
      run_on_and_off(build, tmp_path))
  assert on == off and len(on) > 100
  assert on_counts == off_counts
  assert on_user == off_user and len(on_user) == 2
  (note, ) = [m for m in messages if 'on the fast path' in m]
  # The map side in one loop: the DoFn, Filter, Partition, the windowed
  # combine's precombine, the CoGroupByKey's tagging.
  (stage, ) = [s for s in note.split(': ', 1)[1].split('; ')
               if s.startswith('Split+NotW1+')]
  for name in ('Partition', 'CountInWindow', 'CoGroupByKey', 'KvSwap'):
    assert name in stage, note


class TornDown(beam.DoFn):
  """Marks each of its setups and teardowns with a file of its own."""
  def __init__(self, log_dir):
    self.log_dir = log_dir

  def _mark(self, what):
    name = f'{what}-{os.getpid()}-{id(self)}'
    with open(os.path.join(self.log_dir, name), 'w', encoding='utf-8'):
      pass

  def setup(self):
    self._mark('setup')

  def process(self, n):
    yield n

  def teardown(self):
    self._mark('teardown')


def _plus_sum(x, side):
  return x + sum(side)


def _python_workers() -> int:
  """Spark's Python workers on this (local) machine: the daemon's forks."""
  import psutil
  forks = 0
  for child in psutil.Process().children(recursive=True):
    try:
      if 'beam_pyspark.spark.daemon' in ' '.join(child.cmdline()):
        forks += 1
    except psutil.Error:  # ended meanwhile, or a zombie
      pass
  return forks - 1  # the daemon itself


def _leave_idle_python_workers() -> int:
  """Leaves Spark more idle Python workers than a release has tasks (a
  task per slot), as a job does whose tasks read persisted outputs (a
  side input, a Flatten of two groupings): such a task holds a Python
  worker for each level it computes. Spark hands idle workers out oldest
  first."""
  with beam.Pipeline(options=spark_options()) as p:
    numbers = p | beam.Create(range(1000))
    side = p | 'Side' >> beam.Create([1, 2, 3])
    plus = numbers | beam.Map(_plus_sum, beam.pvalue.AsList(side))
    by_7 = numbers | 'By7' >> beam.Map(lambda x: (x % 7, x)) | beam.GroupByKey()
    by_5 = plus | 'By5' >> beam.Map(lambda x: (x % 5, x)) | 'G5' >> beam.GroupByKey()
    _ = (by_7, by_5) | beam.Flatten() | beam.Map(str)
  return _python_workers()


def test_a_release_job_only_where_a_worker_holds_something(small_text,
                                                           tmp_path):
  """A batch pipeline all on the fast path whose DoFns have no setup or
  teardown leaves nothing to release: no release Spark job (a task per
  slot, the largest fixed cost of a small pipeline). One with a teardown
  still gets its release, which reaches every Python worker holding one of
  its DoFns though Spark has more idle workers than slots (a release of
  one round of a task per slot missed some: their teardowns waited for
  the idle reaper, minutes later). The job's action runs in its one
  terminal stage's Python worker (pipelined onto the stage's RDD, not a
  second worker fed through a JVM union)."""
  from pyspark import SparkContext
  from pyspark.rdd import RDD
  from pyspark.rdd import PipelinedRDD
  from beam_pyspark.spark import release

  jobs = {}
  actions = []
  foreach = RDD.foreach

  def spied(rdd, f):
    actions.append(isinstance(rdd, PipelinedRDD) and rdd._is_pipelinable())  # pylint: disable=protected-access
    return foreach(rdd, f)

  for name, fn in (('plain', beam.Map(len)), ('torn', None)):
    log_dir = tmp_path / name
    log_dir.mkdir()
    if fn is None:
      idle = _leave_idle_python_workers()
      assert idle > 2 * SparkContext.getOrCreate().defaultParallelism, idle
    p = beam.Pipeline(options=spark_options())
    _ = (p | ReadFromText(small_text) | beam.Map(str.upper)
         | (fn or beam.ParDo(TornDown(str(log_dir)))))
    RDD.foreach = spied
    try:
      result = p.run()
      result.wait_until_finish()
    finally:
      RDD.foreach = foreach
    release.wait_for_releases(60.0)
    tracker = SparkContext.getOrCreate().statusTracker()
    marks = os.listdir(log_dir)
    jobs[name] = (
        len(tracker.getJobIdsForGroup(f'{result.job_id}-release')),
        sorted(m.split('-', 1)[1] for m in marks if m.startswith('setup')),
        sorted(m.split('-', 1)[1] for m in marks if m.startswith('teardown')))
  assert jobs['plain'] == (0, [], []), jobs
  released, set_up, torn = jobs['torn']
  assert released >= 1 and set_up and torn == set_up, jobs
  assert actions == [True, True], actions
