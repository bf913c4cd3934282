"""Beam's own WordCount, unchanged, on our runner vs the DirectRunner."""

import glob
import os
import random
import subprocess
import sys

import pytest

VOCAB = [
    'river', 'bridge', 'stone', 'song', 'road', 'map', 'promise', 'boat',
    'mill', "miller's", 'fiddler', 'tune', 'market', 'wool', 'rain', 'the',
    'a', 'of', 'and', 'to', 'in', 'that', 'is', 'was', 'it', 'for'
]


def _generate(path, target_bytes, seed=7):
  rng = random.Random(seed)
  words = VOCAB + ['w%d' % i for i in range(5000)]
  written = 0
  with open(path, 'w', encoding='utf-8') as f:
    while written < target_bytes:
      line = ' '.join(rng.choice(words) for _ in range(rng.randint(1, 16)))
      f.write(line + '\n')
      written += len(line) + 1


def _wordcount(runner_args, input_path, output_prefix, log=None):
  cmd = [
      sys.executable, '-m', 'apache_beam.examples.wordcount',
      '--input', input_path, '--output', output_prefix
  ] + runner_args
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  if log is not None:
    log.append(proc.stderr)
  lines = []
  for shard in sorted(glob.glob(output_prefix + '*')):
    with open(shard, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  return sorted(lines)


OURS = ['--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]']
DIRECT = ['--runner=DirectRunner']


@pytest.fixture(scope='module')
def big_input(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('wc') / 'big.txt')
  _generate(path, 4 * 1024 * 1024)
  return path


def test_wordcount_multi_megabyte_matches_direct_runner(big_input, tmp_path):
  log = []
  ours = _wordcount(OURS, big_input, str(tmp_path / 'ours' / 'counts'), log)
  direct = _wordcount(DIRECT, big_input, str(tmp_path / 'direct' / 'counts'))
  assert len(ours) > 5000
  assert ours == direct
  # Its Split (a DoFn of its own), PairWithOne and the combine's
  # precombine run as one loop.
  assert 'fused stages on the fast path' in log[0]
  assert 'Split+PairWithOne+GroupAndSum' in log[0], log[0][-3000:]


def test_wordcount_non_ascii_matches_direct_runner(tmp_path):
  path = tmp_path / 'utf8.txt'
  path.write_text(
      'Café naïve façade jalapeño café\n'
      'Straße straße STRASSE größe\n'
      '東京 大阪 東京 京都 東京\n'
      'Ελληνικά ελληνικά Ελληνικά — emoji 🙂 🙂\n'
      'Ünïcödé ünïcödé résumé résumé résumé\n',
      encoding='utf-8')
  ours = _wordcount(OURS, str(path), str(tmp_path / 'ours' / 'counts'))
  direct = _wordcount(DIRECT, str(path), str(tmp_path / 'direct' / 'counts'))
  assert 'résumé: 3' in ours
  assert ours == direct


def test_failed_write_leaves_no_output_presented_as_done(tmp_path):
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions

  def fail_on_poison(x):
    if x == 'poison':
      raise ValueError('poisoned element')
    return x

  out = str(tmp_path / 'out' / 'result')
  p = beam.Pipeline(options=PipelineOptions(OURS))
  (
      p | beam.Create(['a', 'b', 'poison', 'c'] * 50)
      | beam.Map(fail_on_poison)
      | beam.io.WriteToText(out))
  result = p.run()
  with pytest.raises(Exception, match='poisoned element'):
    result.wait_until_finish()
  assert result.state == 'FAILED'
  finished = [
      f for f in glob.glob(out + '*') if os.path.isfile(f)
  ]
  assert finished == []
