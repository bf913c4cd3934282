"""Unbounded reads on the streaming engine, end to end on local Spark: a
backlog skewed onto one restriction read over many micro-batches without
a record lost, busy restrictions split by the runner, the runner's
streaming metrics, and a directory watched as files arrive."""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import pytest

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.io.restriction_trackers import OffsetRange
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse
from apache_beam.utils.timestamp import Timestamp

from beam_pyspark.spark.batchlog import METRICS_NAMESPACE

import streaming_recovery_job as job

RUNNER = 'beam_pyspark.PySparkRunner'

# Shard 0 holds most of the records, at event times one second apart; the
# other two a few, far apart: their watermarks race ahead of shard 0's.
SKEWED = {0: [i for i in range(600)], 1: [200 * i for i in range(30)],
          2: [200 * i + 7 for i in range(30)]}


class _ShardProvider(job.ShardProvider):
  def initial_restriction(self, shard):
    return OffsetRange(0, len(SKEWED[shard]))


class _SkewedShards(beam.DoFn):
  """Reads a shard's records in order, never checkpointing itself: only
  the runner's grants stop it; its watermark is its last record's time."""
  @beam.DoFn.unbounded_per_element()
  def process(
      self, shard,
      tracker=beam.DoFn.RestrictionParam(_ShardProvider()),
      estimator=beam.DoFn.WatermarkEstimatorParam(
          ManualWatermarkEstimator.default_provider())):
    position = tracker.current_restriction().start
    while tracker.try_claim(position):
      at = Timestamp(SKEWED[shard][position])
      estimator.set_watermark(at)
      yield window.TimestampedValue(shard, at)
      position += 1


def _expected_counts():
  counts = {}
  for times in SKEWED.values():
    for t in times:
      start = t - t % 60
      counts[start] = counts.get(start, 0) + 1
  return sorted(counts.items())


def test_a_skewed_backlog_loses_no_record_and_busy_reads_split(caplog):
  """Spark's own watermark (the maximum event time seen, minus a delay)
  dropped 950 of 1,089 such records in a spike. Here each read's output
  watermark is its slowest restriction's, so every window is complete
  when it fires; the busy shard is split by the runner into more
  endpoints, which share the later budgets."""
  caplog.set_level(logging.DEBUG, logger='beam_pyspark.runner')

  def window_start(count, w=beam.DoFn.WindowParam):
    return int(w.start.micros // 1_000_000), count

  options = PipelineOptions([
      '--streaming', '--spark_master_url=local[2]', '--spark_parallelism=4',
      '--max_records_per_batch=60'])
  p = beam.Pipeline(RUNNER, options=options)
  counts = (
      p | beam.Create(sorted(SKEWED)) | beam.ParDo(_SkewedShards())
      | beam.WindowInto(window.FixedWindows(60))
      | beam.Map(lambda _: ('all', 1)) | beam.CombinePerKey(sum)
      | beam.Map(lambda kv: kv[1]) | beam.Map(window_start))
  assert_that(counts, equal_to(_expected_counts()))
  result = p.run()
  result.wait_until_finish()

  left = [int(m.group(1)) for m in (
      re.search(r'(\d+) left', r.getMessage()) for r in caplog.records)
          if m]
  assert max(left) > len(SKEWED), (
      f'no busy restriction was split: endpoints per batch {left}')
  # Records read in micro-batches of at most the budget: 660 records
  # at 60 a batch take at least 11 batches after the first.
  batches = result.metrics().query(MetricsFilter().with_namespace(
      METRICS_NAMESPACE).with_name('micro_batches'))['counters']
  assert batches[0].committed >= 1 + 660 // 60
  granted = result.metrics().query(MetricsFilter().with_namespace(
      METRICS_NAMESPACE).with_name('records_granted'))['counters']
  assert granted[0].committed <= 60 * batches[0].committed


class _Note(beam.DoFn):
  """Appends each line it sees to a file (the test's view of progress)."""
  def __init__(self, path):
    self.path = path

  def process(self, line):
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
      os.write(fd, (line + '\n').encode())
    finally:
      os.close(fd)
    yield line


def test_a_watched_directory_is_read_as_files_arrive(tmp_path):
  """fileio.MatchContinuously (Beam's Watch: a splittable DoFn that polls,
  then claims) over a directory written to while the job runs: files that
  appear once the job has read the first are read too, every line once."""
  incoming = tmp_path / 'incoming'
  incoming.mkdir()
  (incoming / 'a.txt').write_text('a1\na2\n')
  seen = tmp_path / 'seen'

  def write_more():
    deadline = time.monotonic() + 240
    while not (seen.exists() and 'a1' in seen.read_text()):
      if time.monotonic() > deadline:
        return
      time.sleep(0.1)
    for name in ('b', 'c'):
      tmp = tmp_path / f'{name}.tmp'
      tmp.write_text(f'{name}1\n{name}2\n')
      os.replace(tmp, incoming / f'{name}.txt')

  writer = threading.Thread(target=write_more, daemon=True)
  writer.start()
  options = PipelineOptions(['--streaming', '--spark_master_url=local[2]'])
  with beam.Pipeline(RUNNER, options=options) as p:
    # Polls counted from the first one on: six, a second apart.
    lines = (
        p | fileio.MatchContinuously(
            str(incoming / '*.txt'), interval=1.0,
            start_timestamp=Timestamp.now(),
            stop_timestamp=Timestamp.now() + 6)
        | fileio.ReadMatches()
        | beam.FlatMap(lambda f: f.read_utf8().splitlines())
        | beam.ParDo(_Note(str(seen))))
    assert_that(lines, equal_to(['a1', 'a2', 'b1', 'b2', 'c1', 'c2']))
  writer.join()


# -- drain ------------------------------------------------------------------------


class _Record(beam.DoFn):
  """Writes each window's pane to OUT/<window start>-<pane index>, through
  a temporary name and a rename."""
  def __init__(self, out):
    self.out = out

  def name_and_text(self, kv, w, pane):
    return (f'{int(w.start.micros)}-{pane.index}',
            ' '.join(str(t) for t in sorted(kv[1])))

  def process(self, kv, w=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
    name, text = self.name_and_text(kv, w, pane)
    tmp = os.path.join(self.out, f'.{name}.{os.getpid()}')
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(tmp, os.path.join(self.out, name))


@pytest.mark.parametrize('drained_by', ['result', 'status page'])
def test_a_drained_job_ends_drained_with_every_window_complete(
    tmp_path, drained_by):
  """A PeriodicImpulse that would never end, drained while it runs (by
  ``result.drain()`` or the status page's Drain button): its reads stop at
  what they hold (PeriodicImpulse truncates to nothing left), its
  watermark goes to +inf, every window fires once with every element read
  for it, and the job ends DRAINED."""
  import json
  import urllib.request
  from apache_beam.runners.runner import PipelineState
  from beam_pyspark.runner import status_page
  out = tmp_path / 'out'
  out.mkdir()
  start = int(time.time()) + 1
  options = PipelineOptions(['--streaming', '--spark_master_url=local[2]',
                             '--status_port=0'])
  p = beam.Pipeline(RUNNER, options=options)
  _ = (p | PeriodicImpulse(start_timestamp=start, fire_interval=0.25)
       | beam.Map(lambda t: ('all', round(float(t) * 4)))
       | beam.WindowInto(window.FixedWindows(2)) | beam.GroupByKey()
       | beam.ParDo(_Record(str(out))))
  result = p.run()
  deadline = time.monotonic() + 180
  while len(os.listdir(out)) < 2:  # two windows fired: it is streaming
    assert result.state in (PipelineState.STARTING,
                            PipelineState.RUNNING), result.state
    assert time.monotonic() < deadline, 'no window fired'
    time.sleep(0.2)
  # The status page shows the running job's watermarks, its impulse's
  # live restriction and its micro-batches (once its first micro-batch is
  # committed: a slow first one may have fired both windows itself).
  while True:
    with urllib.request.urlopen(
        f'{status_page()}api/jobs/{result.job_id}', timeout=30) as page:
      streaming = json.load(page)['streaming']
    if streaming['micro_batches'] and streaming['endpoints']:
      break
    assert time.monotonic() < deadline, streaming
    time.sleep(0.2)
  assert any(w['output'] not in (None, '-inf')
             for w in streaming['watermarks'].values()), streaming
  if drained_by == 'result':
    assert result.drain() == PipelineState.DRAINED
  else:
    page = f'{status_page()}jobs/{result.job_id}'
    with urllib.request.urlopen(page, timeout=30) as html:
      assert b'id="drain"' in html.read()
    origin = status_page().rstrip('/')
    request = urllib.request.Request(f'{page}/drain', data=b'',
                                     method='POST', headers={'Origin': origin})
    with urllib.request.urlopen(request, timeout=30) as answer:
      assert answer.status == 200  # redirected back to the job's page
    assert result.wait_until_finish() == PipelineState.DRAINED
  panes = {}
  for name in os.listdir(out):
    if not name.startswith('.'):
      window_start, index = (int(x) for x in name.split('-'))
      panes.setdefault(window_start, []).append(
          (index, [int(x) for x in (out / name).read_text().split()]))
  # One pane per window: the default trigger, fired once by the watermark.
  assert all(len(v) == 1 and v[0][0] == 0 for v in panes.values()), panes
  ticks = sorted(t for v in panes.values() for t in v[0][1])
  # Every element read, none twice, from the first tick on: the last
  # window fired too (drained: the watermark reached +inf).
  assert ticks == list(range(start * 4, start * 4 + len(ticks)))
  for window_start, ((_, values),) in panes.items():
    assert all(window_start <= t * 250_000 < window_start + 2_000_000
               for t in values)
  # Windows between the first (which starts at ``start``) and the last
  # (cut by the drain) hold all of their 8 ticks.
  full = sorted(panes)[1:-1]
  assert all(len(panes[w][0][1]) == 8 for w in full)
  assert len(panes) >= 2


class _Counts(_Record):
  """Writes each (key, count) of a window's pane to OUT/<start>-<key>-<pane>."""
  def name_and_text(self, kv, w, pane):
    return f'{int(w.start.micros)}-{kv[0]}-{pane.index}', str(kv[1])


def test_a_periodic_impulse_count_read_compact_is_exact(tmp_path):
  """The streaming benchmark's pipeline (PeriodicImpulse -> Map ->
  FixedWindows -> CombinePerKey(sum)), its read's output handed to the fast
  path as compact chunks (worker.sequence.Offsets: several of 8,192
  elements a micro-batch): every window's count per key is what the ticks'
  own float times make, each window fired once."""
  out = tmp_path / 'out'
  out.mkdir()
  start, interval, n = int(time.time()) + 2, 0.0002, 30_000
  p = beam.Pipeline(RUNNER, options=PipelineOptions(
      ['--streaming', '--spark_master_url=local[2]']))
  _ = (p | PeriodicImpulse(start_timestamp=start,
                           stop_timestamp=start + n * interval,
                           fire_interval=interval)
       | beam.Map(lambda t: (round(float(t) * 10_000) % 7, 1))
       | beam.WindowInto(window.FixedWindows(1)) | beam.CombinePerKey(sum)
       | beam.ParDo(_Counts(str(out))))
  p.run().wait_until_finish()
  expected = {}
  for i in range(n):
    t = start + interval * i
    name = f'{int(t) * 1_000_000}-{round(t * 10_000) % 7}-0'
    expected[name] = expected.get(name, 0) + 1
  got = {name: int((out / name).read_text()) for name in os.listdir(out)
         if not name.startswith('.')}
  assert got == expected
