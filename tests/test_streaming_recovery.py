"""Exactly once across a driver's death: the checkpoint's bookkeeping fed
by hand (no Spark), its directory on disk, and a streaming job on local
Spark whose driver is SIGKILLed mid-batch and right after a commit, then
started again, with its output compared to Beam's DirectRunner's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms import trigger
from apache_beam.transforms import window

from beam_pyspark import PySparkRunner
from beam_pyspark.spark.checkpoints import CheckpointDir
from beam_pyspark.streaming.checkpoints import KEEP_MANIFESTS
from beam_pyspark.streaming.checkpoints import CheckpointMismatch
from beam_pyspark.streaming.checkpoints import ManifestBook
from beam_pyspark.streaming.checkpoints import fingerprint

import streaming_recovery_job as job

HERE = os.path.dirname(os.path.abspath(__file__))

# -- the bookkeeping, fed by hand ------------------------------------------------


def _components(*names):
  components = beam_runner_api_pb2.Components()
  for name in names:
    components.transforms[name].unique_name = name
    components.transforms[name].spec.urn = 'beam:transform:pardo:v1'
  return components


def test_a_batch_commits_only_what_changed():
  book = ManifestBook('fp')
  book.changed(('state', 'gbk', 0), 'f0')
  book.changed(('state', 'gbk', 1), 'f1')
  first = book.commit(0, {'now': 1})
  book.changed(('state', 'gbk', 1), 'f2')
  second = book.commit(1, {'now': 2})
  assert first.files == {('state', 'gbk', 0): 'f0', ('state', 'gbk', 1): 'f1'}
  assert second.files == {('state', 'gbk', 0): 'f0', ('state', 'gbk', 1): 'f2'}
  book.changed(('state', 'gbk', 0), None)  # that partition's state is gone
  third = book.commit(2, {'now': 3})
  assert third.files == {('state', 'gbk', 1): 'f2'}


def test_garbage_is_what_no_kept_manifest_names():
  book = ManifestBook('fp')
  book.changed(('state', 'a', 0), 'old')
  book.changed(('state', 'b', 0), 'kept')
  book.commit(0, {})
  for batch in range(1, KEEP_MANIFESTS + 1):
    book.changed(('state', 'a', 0), f'new{batch}')
    book.commit(batch, {})
  manifests, files = book.garbage()
  assert manifests == [0]
  # 'kept' is still named by the kept manifests; new1 by one of them.
  assert files == ['old']
  assert book.live() == {'kept', 'new1', 'new2'}
  assert book.garbage() == ([], [])


def test_a_resumed_book_starts_from_the_latest_manifest():
  book = ManifestBook('fp')
  book.changed(('side', b'buf', 0), 's0')
  m0 = book.commit(0, {})
  book.changed(('side', b'buf', 1), 's1')
  m1 = book.commit(1, {})
  resumed = ManifestBook('fp', [m1, m0])
  assert resumed.latest.batch == 1
  assert resumed.keys('side', b'buf') == [('side', b'buf', 0),
                                          ('side', b'buf', 1)]
  assert resumed.keys('state') == []


def test_another_pipelines_checkpoint_is_refused():
  book = ManifestBook(fingerprint(_components('Read', 'Count')))
  manifest = book.commit(0, {})
  with pytest.raises(CheckpointMismatch, match='--checkpoint_location'):
    ManifestBook(fingerprint(_components('Read', 'Sum')), [manifest])
  # The same graph built again is the same pipeline.
  ManifestBook(fingerprint(_components('Count', 'Read')), [manifest])


def test_checkpoint_dir_commits_by_rename_and_sweeps_what_no_manifest_names(
    tmp_path):
  directory = CheckpointDir(str(tmp_path / 'cp'))
  book = ManifestBook('fp')
  book.changed(('state', 'n', 0), directory.write_file(0, b'zero'))
  directory.commit(book.commit(0, {'now': 5}))
  orphan = directory.write_file(1, b'never committed')
  (tmp_path / 'cp' / 'manifests' / '1.tmp-123').write_bytes(b'half')
  again = CheckpointDir(str(tmp_path / 'cp'))
  manifests = again.manifests()
  assert [m.batch for m in manifests] == [0]
  resumed = ManifestBook('fp', manifests)
  again.sweep(resumed.live())
  assert again.read_file(resumed.file_of(('state', 'n', 0))) == b'zero'
  assert orphan not in os.listdir(tmp_path / 'cp' / 'files')
  assert os.listdir(tmp_path / 'cp' / 'manifests') == ['0']


# -- metrics across micro-batches --------------------------------------------------


class _Count(beam.DoFn):
  def __init__(self):
    self.panes = Metrics.counter('recovery', 'panes')

  def process(self, element):
    self.panes.inc()
    yield element


def test_committed_metrics_count_every_wave():
  # Committed metrics keep each task's last attempt: a partition's task in
  # each wave is another task, not a retry of the one before. Here one
  # micro-batch fires an early pane (first wave) and, once its watermark
  # passes the window, the on-time pane (second wave) into one stage.
  stream = (TestStream().add_elements([window.TimestampedValue(('k', 1), 1)])
            .advance_watermark_to(100).advance_watermark_to_infinity())
  p = beam.Pipeline(PySparkRunner(), options=PipelineOptions(['--streaming']))
  _ = (p | stream
       | beam.WindowInto(
           window.FixedWindows(10),
           trigger=trigger.AfterWatermark(early=trigger.AfterCount(1)),
           accumulation_mode=trigger.AccumulationMode.ACCUMULATING)
       | beam.GroupByKey() | beam.ParDo(_Count()))
  result = p.run()
  result.wait_until_finish()
  counters = result.metrics().query(
      MetricsFilter().with_name('panes'))['counters']
  assert [(c.committed, c.attempted) for c in counters] == [(2, 2)]


# -- the driver killed ------------------------------------------------------------


_REFERENCES: dict = {}


@pytest.fixture(scope='module', params=['teststream', 'sdf'])
def source(request):
  """What feeds the job: a TestStream with early and late firings, or an
  unbounded splittable DoFn read over many micro-batches."""
  return request.param


@pytest.fixture
def reference(tmp_path_factory, source):
  """Beam's DirectRunner's output of the same pipeline: streaming for the
  TestStream; for the splittable read (whose panes the watermark alone
  decides) its batch mode, which reads each restriction to its end."""
  if source not in _REFERENCES:
    out = tmp_path_factory.mktemp('direct')
    flags = (['--streaming', '--allow_unsafe_triggers']
             if source == 'teststream' else [])
    with beam.Pipeline('DirectRunner', options=PipelineOptions(flags)) as p:
      job.build(p, str(out), source=source)
    expected = job.read_output(str(out)), job.read_files(str(out))
    assert len(expected[0]) > 20, 'the reference is too small to judge by'
    assert len(expected[1]) >= 3, 'the file sink wrote too little to judge by'
    _REFERENCES[source] = expected
  return _REFERENCES[source]


def _start(out, checkpoint, *flags):
  return subprocess.Popen(
      [sys.executable, os.path.join(HERE, 'streaming_recovery_job.py'),
       str(out), str(checkpoint), *flags],
      cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process, timeout=300):
  try:
    _, err = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    _, err = process.communicate()
    raise AssertionError(f'the job did not finish:\n{err[-3000:]}')
  return process.returncode, err


def _resumed_after(err):
  marker = 'Resuming after micro-batch '
  lines = [line for line in err.splitlines() if marker in line]
  assert lines, f'the job started afresh instead of resuming:\n{err[-3000:]}'
  return int(lines[-1].split(marker)[1].split(',')[0])


def test_driver_killed_mid_batch_resumes_with_exact_output(
    tmp_path, reference, source):
  out, checkpoint = tmp_path / 'out', tmp_path / 'checkpoint'
  out.mkdir()
  flags = ('--kill-mid-batch', f'--source={source}')
  code, err = _finish(_start(out, checkpoint, *flags))
  assert code == -signal.SIGKILL, err[-3000:]
  assert (out / 'killed').exists()
  assert os.listdir(checkpoint / 'manifests'), 'nothing was committed'
  code, err = _finish(_start(out, checkpoint, *flags))
  assert code == 0, err[-3000:]
  assert _resumed_after(err) >= 2
  assert (job.read_output(str(out)), job.read_files(str(out))) == reference
  assert not checkpoint.exists(), 'a DONE job keeps no checkpoint'


def test_driver_killed_right_after_a_commit_resumes_with_exact_output(
    tmp_path, reference, source):
  out, checkpoint = tmp_path / 'out', tmp_path / 'checkpoint'
  out.mkdir()
  process = _start(out, checkpoint, f'--source={source}')
  batch = 5 if source == 'teststream' else 3
  target = checkpoint / 'manifests' / str(batch)
  deadline = time.monotonic() + 300
  while not target.exists() and process.poll() is None:
    assert time.monotonic() < deadline, f'batch {batch} never committed'
    time.sleep(0.002)
  process.send_signal(signal.SIGKILL)
  code, err = _finish(process)
  assert code == -signal.SIGKILL, f'the job ended before the kill:\n{err}'
  code, err = _finish(_start(out, checkpoint, f'--source={source}'))
  assert code == 0, err[-3000:]
  assert _resumed_after(err) >= batch
  assert (job.read_output(str(out)), job.read_files(str(out))) == reference


def test_stage_keys_survive_fusions_numbering():
  from beam_pyspark.streaming.checkpoints import stage_key
  # Two processes fused the same Flatten's inputs in another order.
  assert stage_key(['A/Read', 'ParDo(f)', 'Flatten/Write/0']) == stage_key(
      ['A/Read', 'Flatten/Write/1', 'ParDo(f)'])
  assert stage_key(['A/Read', 'ParDo(f)']) != stage_key(['A/Read', 'ParDo(g)'])
