"""Windowed file writes keep every shard: Python's sinks against Beam's
DirectRunner, file by file.

A windowed write numbers its shards per window when it finalizes; if two
bundles or two partitions of one window finalized apart, both would name
their files ``0-of-1`` and the second would overwrite the first: a job
DONE with records missing (issue 39). Each pipeline here writes a few
thousand timestamped lines over several windows with several input
partitions, on this runner and on the DirectRunner; the files must name
every shard ``i`` of one ``n`` per window, and hold per window exactly the
DirectRunner's lines.
"""

from __future__ import annotations

import collections
import os
import re

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import window

LINES = 3000
WINDOW_SECS = 60


def _events():
  # Deterministic spread over 7 windows, interleaved so that every input
  # partition holds lines of every window.
  return [(f'line {i:05d} word{i % 37}', (i * 7919) % (7 * WINDOW_SECS))
          for i in range(LINES)]


def _run(runner_args, build) -> None:
  with beam.Pipeline(options=PipelineOptions(runner_args)) as p:
    lines = (
        p | beam.Create(_events(), reshuffle=False)
        | beam.Reshuffle()  # several bundles (partitions) per window
        | beam.Map(lambda e: window.TimestampedValue(e[0], e[1]))
        | beam.WindowInto(window.FixedWindows(WINDOW_SECS)))
    build(lines)


OURS = ['--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
        '--spark_parallelism=4']
DIRECT = ['--runner=DirectRunner']

# fileio's default naming: prefix-<window start>-<window end>-<pane>-
# <shard>-of-<shards><suffix>.
_SHARD = re.compile(r'^(?P<window>.*)-(?P<shard>\d{5})-of-(?P<of>\d{5})\.txt$')


def _shards(directory: str) -> dict[str, tuple[set, set, list]]:
  """Per window: the shard indices, the shard counts and the lines."""
  found: dict = collections.defaultdict(lambda: (set(), set(), []))
  for name in sorted(os.listdir(directory)):
    if name.startswith('.temp'):  # fileio's temporary directory
      continue
    m = _SHARD.match(name)
    assert m, f'unexpected file {name!r} in {directory}'
    indices, counts, lines = found[m.group('window')]
    indices.add(int(m.group('shard')))
    counts.add(int(m.group('of')))
    with open(os.path.join(directory, name), encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  return dict(found)


def _write_to_files(path):
  def build(lines):
    lines | fileio.WriteToFiles(
        path=path,
        file_naming=fileio.default_file_naming('out', '.txt'))
  return build


def test_windowed_write_to_files_keeps_every_shard(tmp_path):
  ours, direct = str(tmp_path / 'ours'), str(tmp_path / 'direct')
  _run(DIRECT, _write_to_files(direct))
  _run(OURS, _write_to_files(ours))
  _same_windows(_shards(ours), _shards(direct))


def _same_windows(got, expected):
  assert len(expected) == 7
  assert sorted(got) == sorted(expected)
  for w, (indices, counts, lines) in got.items():
    # One n per window, every i of it: no two finalizations of one window.
    assert len(counts) == 1, (w, counts)
    assert indices == set(range(counts.pop())), (w, indices)
    assert sorted(lines) == sorted(expected[w][2]), w
  assert sum(len(v[2]) for v in got.values()) == LINES


def test_windowed_write_to_files_spilled_to_shards_keeps_every_shard(
    tmp_path):
  """One writer a bundle: the records of every other window spill to
  fileio's sharded path (a GroupByKey per destination, window and shard)."""
  def build(path):
    def apply(lines):
      lines | fileio.WriteToFiles(
          path=path, shards=3, max_writers_per_bundle=1,
          file_naming=fileio.default_file_naming('out', '.txt'))
    return apply
  ours, direct = str(tmp_path / 'ours'), str(tmp_path / 'direct')
  _run(DIRECT, build(direct))
  _run(OURS, build(ours))
  _same_windows(_shards(ours), _shards(direct))


def test_write_to_text_after_windowing_keeps_every_line(tmp_path):
  """A bounded WriteToText rewindows into the global window (Beam's
  WriteImpl): every line once, in shards numbered i-of-n."""
  def build(prefix):
    def apply(lines):
      lines | beam.io.WriteToText(prefix, num_shards=0)
    return apply
  _run(DIRECT, build(str(tmp_path / 'direct' / 'out')))
  _run(OURS, build(str(tmp_path / 'ours' / 'out')))

  def read(directory):
    names = sorted(os.listdir(directory))
    n = {int(re.search(r'-of-(\d+)', x).group(1)) for x in names}
    assert len(n) == 1 and len(names) == n.pop(), names
    out = []
    for name in names:
      with open(os.path.join(directory, name), encoding='utf-8') as f:
        out.extend(f.read().splitlines())
    return sorted(out)
  assert read(str(tmp_path / 'ours')) == read(str(tmp_path / 'direct'))
  assert len(read(str(tmp_path / 'ours'))) == LINES
