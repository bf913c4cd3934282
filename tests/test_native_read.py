"""Bounded reads split by the runner and read in the harness without SDF
(planning.reads, spark.reads, worker.reads), on real Spark local[2]."""

from __future__ import annotations

import gzip
import random
import re

import pytest

import apache_beam as beam
from apache_beam.io import iobase
from apache_beam.io.range_trackers import OffsetRangeTracker
from apache_beam.runners.runner import PipelineState
from apache_beam.transforms import environments

from beam_pyspark.planning import plan_pipeline
from beam_pyspark.spark import reads as spark_reads

from conftest import WriteToDir
from conftest import read_dir
from conftest import spark_options

SPLITS_MESSAGE = re.compile(r'(\d+) splits of the source .* packed into (\d+) '
                            r'partitions')


def _lines(name: str, count: int) -> list[str]:
  # Distinct lines of varying length, so a line lost or read twice at a
  # split boundary shows.
  return [f'{name} line {i} ' + 'x' * (i % 37) for i in range(count)]


@pytest.fixture(scope='module')
def text_files(tmp_path_factory):
  """A directory of text files and the lines Beam must read from them."""
  d = tmp_path_factory.mktemp('texts')
  expected = []

  def write(name, lines, trailing_newline=True, compress=False, sep='\n'):
    data = sep.join(lines) + (sep if trailing_newline and lines else '')
    raw = data.encode('utf-8')
    path = d / name
    if compress:
      with gzip.open(path, 'wb') as f:
        f.write(raw)
    else:
      path.write_bytes(raw)
    expected.extend(lines)

  # Large enough (with the rest, more than 2 x 1 MiB) to be split itself.
  write('big.txt', _lines('big', 120_000))
  write('small.txt', _lines('small', 500))
  write('no_newline.txt', _lines('no_newline', 300), trailing_newline=False)
  write('one_line_no_newline.txt', ['lonely'], trailing_newline=False)
  write('empty.txt', [])
  write('also_empty.txt', [])
  write('blank_lines.txt', ['', 'after a blank', '', ''])
  write('unicode.txt', ['naïve café', 'ünïcødé ✓'])
  write('crlf.txt', _lines('crlf', 50), sep='\r\n')
  write('compressed.txt.gz', _lines('gz', 20_000), compress=True)
  return d, expected


def _run(build, client_log=None):
  """Runs ``build(p) -> PCollection`` on our runner; (elements, result)."""
  import tempfile
  out = tempfile.mkdtemp(prefix='native-read-')
  p = beam.Pipeline(options=spark_options())
  _ = build(p) | 'Collect' >> beam.ParDo(WriteToDir(out))
  result = p.run()
  result.wait_until_finish()
  return sorted(read_dir(out)), result


def _splits_messages(client_log) -> list[tuple[int, int]]:
  found = []
  for _, text in client_log.seen:
    m = SPLITS_MESSAGE.search(text)
    if m:
      found.append((int(m.group(1)), int(m.group(2))))
  return found


def _spark_jobs(result) -> int:
  from pyspark import SparkContext
  sc = SparkContext._active_spark_context
  return len(sc.statusTracker().getJobIdsForGroup(result.job_id))


def test_read_from_text_glob_matches_the_files_exactly(text_files, client_log):
  d, expected = text_files
  got, result = _run(
      lambda p: p | beam.io.ReadFromText(str(d / '*')), client_log)
  assert result.state == PipelineState.DONE
  assert len(got) == len(expected)
  assert got == sorted(expected)
  # The big file is split in two or more, each other non-empty file is one
  # split (the gzip file is not splittable), empty files are none.
  (splits, partitions), = _splits_messages(client_log)
  assert splits >= 9, client_log.seen
  assert partitions == 2
  # No Spark job is spent on sizing or splitting: the one action writes.
  assert _spark_jobs(result) == 1


def test_several_reads_flattened_match_the_direct_runner(text_files, collect):
  d, _ = text_files

  def build(p):
    a = p | 'Glob' >> beam.io.ReadFromText(str(d / '*.txt'))
    b = p | 'Gz' >> beam.io.ReadFromText(str(d / 'compressed.txt.gz'))
    c = p | 'NoNewline' >> beam.io.ReadFromText(str(d / 'no_newline.txt'))
    return ((a, b, c) | beam.Flatten()
            | beam.Map(lambda line: (line.split(' ')[0], len(line)))
            | beam.CombinePerKey(sum))

  ours, reference = collect.both(build)
  assert ours == reference
  assert len(ours) > 5


def test_read_from_text_with_header_skipping_and_line_numbers(text_files,
                                                              collect):
  d, _ = text_files

  def build(p):
    return (p | beam.io.ReadFromText(str(d / 'small.txt'), skip_header_lines=3)
            | beam.Map(lambda line: int(line.split(' ')[2])))

  ours, reference = collect.both(build)
  assert ours == reference == list(range(3, 500))


class SquaresSource(iobase.BoundedSource):
  """Records (i, i * i) for i in [0, count); each record counts as
  ``record_bytes`` bytes, so the runner splits it like a big file."""
  def __init__(self, count, record_bytes=1 << 18, fail_at=None):
    self.count = count
    self.record_bytes = record_bytes
    self.fail_at = fail_at

  def estimate_size(self):
    return self.count * self.record_bytes

  def split(self, desired_bundle_size, start_position=None,
            stop_position=None):
    start = start_position or 0
    stop = self.count if stop_position is None else stop_position
    step = max(1, desired_bundle_size // self.record_bytes)
    for lo in range(start, stop, step):
      hi = min(stop, lo + step)
      yield iobase.SourceBundle((hi - lo) * self.record_bytes, self, lo, hi)

  def get_range_tracker(self, start_position, stop_position):
    return OffsetRangeTracker(
        start_position or 0,
        self.count if stop_position is None else stop_position)

  def read(self, range_tracker):
    i = range_tracker.start_position()
    while range_tracker.try_claim(i):
      if i == self.fail_at:
        fail_reading_record(i)
      yield i, i * i
      i += 1

  def default_output_coder(self):
    return beam.coders.TupleCoder(
        [beam.coders.VarIntCoder(), beam.coders.VarIntCoder()])


def fail_reading_record(i):
  raise IOError(f'record {i} of the squares is unreadable')


def test_custom_bounded_source_is_split_and_read(collect, client_log):
  build = lambda p: p | beam.io.Read(SquaresSource(40))
  ours, reference = collect.both(build)
  assert ours == reference == [(i, i * i) for i in range(40)]
  # 40 records of 256 KiB, 2 partitions: desired 5 MiB, so 20 per split.
  assert (2, 2) in _splits_messages(client_log)


class UnweightedSquares(SquaresSource):
  def split(self, *args, **kwargs):
    for bundle in super().split(*args, **kwargs):
      yield iobase.SourceBundle(None, *bundle[1:])


def test_splits_without_weights_are_spread_over_partitions(collect,
                                                            client_log):
  got = collect.spark(lambda p: p | beam.io.Read(UnweightedSquares(80)))
  assert got == [(i, i * i) for i in range(80)]
  # 80 records of 256 KiB: desired 10 MiB, 40 a split.
  assert (2, 2) in _splits_messages(client_log)


def test_custom_source_with_a_downstream_group(collect):
  def build(p):
    return (p | beam.io.Read(SquaresSource(100, record_bytes=1 << 16))
            | beam.Map(lambda kv: (kv[0] % 7, kv[1]))
            | beam.GroupByKey()
            | beam.MapTuple(lambda k, vs: (k, sorted(vs))))

  ours, reference = collect.both(build)
  assert ours == reference
  assert len(ours) == 7


def test_a_source_whose_read_raises_fails_the_job_with_the_traceback():
  p = beam.Pipeline(options=spark_options())
  _ = (p | beam.io.Read(SquaresSource(30, fail_at=17))
       | beam.Map(lambda kv: kv[1]))
  result = p.run()
  with pytest.raises(Exception) as raised:
    result.wait_until_finish()
  message = str(raised.value)
  assert 'record 17 of the squares is unreadable' in message
  assert 'fail_reading_record' in message
  assert 'test_native_read.py' in message
  assert result.state == PipelineState.FAILED


class _DriverShy:
  """Unpickles everywhere but in the runner's driver thread: as a source
  whose module is only among the job's staged dependencies would."""
  def __reduce__(self):
    return (_unpickle_driver_shy, ())


def _unpickle_driver_shy():
  import threading
  if threading.current_thread().name.startswith('beam-pyspark-job-'):
    raise ImportError('no module named driver_shy (on the driver)')
  return _DriverShy()


class DriverShySquares(SquaresSource):
  def __init__(self, count):
    super().__init__(count)
    self.shy = _DriverShy()


def test_a_source_the_driver_cannot_unpickle_is_split_in_an_executor(
    collect, client_log):
  got = collect.spark(lambda p: p | beam.io.Read(DriverShySquares(40)))
  assert got == [(i, i * i) for i in range(40)]
  texts = [t for _, t in client_log.seen]
  assert any('splitting it in an executor' in t for t in texts), texts
  assert (2, 2) in _splits_messages(client_log)


def test_a_source_that_splits_to_nothing_reads_nothing(collect):
  got = collect.spark(lambda p: p | beam.io.Read(SquaresSource(0)))
  assert got == []


def _stage_kinds(environment) -> list[str]:
  p = beam.Pipeline()
  _ = p | beam.io.Read(SquaresSource(10)) | beam.Map(str)
  plan = plan_pipeline(p.to_runner_api(default_environment=environment))
  return [s.kind for s in plan.stages]


def test_only_the_embedded_environment_gets_the_native_read():
  assert _stage_kinds(
      environments.EmbeddedPythonEnvironment.default()) == ['read', 'sdk']
  # Other environments keep Beam's SDF expansion (split, sized reshuffle,
  # process).
  process = environments.ProcessEnvironment('/bin/true')
  kinds = _stage_kinds(process)
  assert 'read' not in kinds and 'reshuffle' in kinds
  external = environments.ExternalEnvironment('localhost:1')
  assert 'read' not in _stage_kinds(external)


def test_desired_split_bytes():
  assert spark_reads.desired_split_bytes(None, 2) == 64 << 20
  assert spark_reads.desired_split_bytes(0, 2) == 64 << 20
  assert spark_reads.desired_split_bytes(1000, 2) == 1 << 20
  assert spark_reads.desired_split_bytes(100 << 20, 4) == 25 << 20


class PaddedSquares(SquaresSource):
  """A source whose pickle grows with ``padding``."""
  def __init__(self, count, padding: bytes):
    super().__init__(count)
    self.padding = padding


@pytest.mark.parametrize('padding', [0, 4500])
def test_the_driver_unpickles_sources_of_any_size(padding):
  # Beam wraps the pickled source in a BytesValue; its length bytes once
  # reached the base64 decoder, which kept those that are base64 letters
  # (a pickle of about 6.3 KiB: its second length byte is '1').
  import random
  padded = PaddedSquares(10, random.Random(padding).randbytes(padding))
  p = beam.Pipeline()
  _ = p | beam.io.Read(padded) | beam.Map(str)
  plan = plan_pipeline(p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default()))
  (read, ) = [s for s in plan.stages if s.kind == 'read']
  _, _, splits = spark_reads.split_source(read.read_payload, 2)
  assert splits


@pytest.mark.parametrize('data', [
    b'a\r\nbb\r\n\r\nccc\r\n', b'a\rb\nc\r\n\n\r\rd\r\n\re\n', b'x\ny\nlast',
    b'', b'\n\n\n', 'naïve café\nünïcødé ✓\n'.encode('utf-8'),
    bytes(random.Random(1).choice(b'ab\r\n') for _ in range(300))
], ids=['crlf', 'lone-cr', 'no-newline', 'empty', 'blank', 'utf-8', 'random'])
@pytest.mark.parametrize('block', [3, 1 << 20])
def test_plain_text_lines_are_beams_records_at_every_split(
    tmp_path, monkeypatch, data, block):
  # worker.textlines reads ReadFromText's splits in blocks, or with
  # readline: the same records as Beam's _TextSource.read_records,
  # wherever a split starts and however blocks end.
  from apache_beam.io.filesystem import CompressionTypes
  from apache_beam.io.textio import _TextSource
  from beam_pyspark.worker import textlines
  from beam_pyspark.worker.textlines import plain_text_records
  monkeypatch.setattr(textlines, 'BLOCK_BYTES', block)
  path = str(tmp_path / 'lines.txt')
  with open(path, 'wb') as f:
    f.write(data)
  coder = beam.coders.StrUtf8Coder()
  for strip in (True, False):
    source = _TextSource(path, 0, CompressionTypes.AUTO, strip, coder,
                         validate=False)
    for desired in range(1, len(data) + 2):
      for bundle in source.split(desired):
        split = bundle.source
        beams = list(split.read(split.get_range_tracker(
            bundle.start_position, bundle.stop_position)))
        ours = plain_text_records(split, bundle.start_position,
                                  bundle.stop_position)
        assert ours is not None
        assert list(ours) == beams, (strip, desired, bundle.start_position)


def test_plain_text_lines_fail_on_bad_utf8_as_beam_does(tmp_path):
  from apache_beam.io.filesystem import CompressionTypes
  from apache_beam.io.textio import _TextSource
  from beam_pyspark.worker.textlines import plain_text_records
  path = str(tmp_path / 'bad.txt')
  with open(path, 'wb') as f:
    f.write(b'good\nbad \xff here\nafter\n')
  source = _TextSource(path, 0, CompressionTypes.AUTO, True,
                       beam.coders.StrUtf8Coder(), validate=False)
  (bundle, ) = source.split(1 << 20)
  split = bundle.source
  errors = []
  for read in (
      lambda: split.read(split.get_range_tracker(None, None)),
      lambda: plain_text_records(split, None, None)):
    with pytest.raises(UnicodeDecodeError) as raised:
      list(read())
    errors.append(str(raised.value))
  assert errors[0] == errors[1]
