"""The benchmark workloads at a tiny size: the three variants agree.

No timing here (timed tests are banned); ``python -m benchmarks.run`` times.
"""

import os
import sys
import time

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  # benchmarks/ is not an installed package; our runner ships the driver's
  # sys.path to its executors, the hand-written jobs get it from
  # benchmarks.workloads.handwritten_pool.
  sys.path.insert(0, REPO_ROOT)

from benchmarks import corpus  # pylint: disable=wrong-import-position
from benchmarks import workloads as wl  # pylint: disable=wrong-import-position

TINY_MB = 0.05
OURS = ['--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]']
# in_memory: the quickest DirectRunner mode to start.
DIRECT = ['--runner=DirectRunner', '--direct_running_mode=in_memory']


@pytest.fixture(scope='module')
def sc():
  from beam_pyspark.spark.session import spark_context
  return spark_context('local[2]')


@pytest.fixture(scope='module')
def corpus_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('bench-corpus'))


@pytest.mark.parametrize('name', sorted(wl.WORKLOADS))
def test_variants_agree(name, sc, corpus_dir, tmp_path):
  workload = wl.WORKLOADS[name]
  paths = {
      role: corpus.ensure(corpus_dir, kind, TINY_MB)
      for role, kind in workload.inputs.items()
  }
  wl.run_beam(workload, OURS, paths, str(tmp_path / 'ours' / 'out'))
  wl.run_pyspark(workload, sc, paths, str(tmp_path / 'pyspark' / 'out'))
  wl.run_beam(workload, DIRECT, paths, str(tmp_path / 'direct' / 'out'))
  ours = wl.digest(str(tmp_path / 'ours' / 'out'))
  assert ours.lines > 0
  assert ours == wl.digest(str(tmp_path / 'pyspark' / 'out'))
  assert ours == wl.digest(str(tmp_path / 'direct' / 'out'))


def test_corpus_is_deterministic(tmp_path):
  a = corpus.ensure(str(tmp_path / 'a'), 'text', 0.02, seed=3)
  b = corpus.ensure(str(tmp_path / 'b'), 'text', 0.02, seed=3)
  c = corpus.ensure(str(tmp_path / 'c'), 'text', 0.02, seed=4)
  with open(a, 'rb') as fa, open(b, 'rb') as fb, open(c, 'rb') as fc:
    da, db, dc = fa.read(), fb.read(), fc.read()
  assert da == db
  assert da != dc
  assert len(da) >= 0.02 * corpus.MB


def test_synthetic_records_are_beams():
  # The hand-written load tests read what Beam's SyntheticSource reads.
  from apache_beam.io.range_trackers import OffsetRangeTracker
  from apache_beam.testing.synthetic_pipeline import SyntheticSource
  from benchmarks import synthetic
  from benchmarks.loadtests import LoadTest
  spec = {'num_records': 300, 'key_size': 4, 'value_size': 20,
          'num_hot_keys': 7, 'hot_key_fraction': 0.5}
  beams = SyntheticSource(LoadTest.source_spec(spec))
  records = list(beams.read(OffsetRangeTracker(100, 250)))
  assert records == list(synthetic.records(spec, 100, 250))
  assert len({k for k, _ in records}) < 150  # hot keys repeat


def test_a_load_test_on_our_runner_and_by_hand(sc):
  # Beam's ParDoTest with 10 counter operations per element: its counter
  # is kept per step on the fast path; the hand-written job runs too.
  from apache_beam.metrics import MetricsFilter
  from benchmarks import loadtests
  from benchmarks import synthetic
  test = loadtests.TESTS['pardo_10_counters']
  options = loadtests._scaled(test.options, 0.004)
  records = options['input_options']['num_records']
  assert records == 2000  # the TESTS' sizes times 0.004
  start = time.perf_counter()
  with loadtests.RunnerEntry() as entry:
    ran = loadtests.run_load_test(test, options, OURS)
  # The runner was handed the pipeline once, within the run.
  assert entry.at is not None and start < entry.at < time.perf_counter()
  (counter, ) = ran.result.metrics().query(
      MetricsFilter().with_name('name-0'))['counters']
  assert counter.committed == records * 10
  synthetic.JOBS[test.job](sc, options)
