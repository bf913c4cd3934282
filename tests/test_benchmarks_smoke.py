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


def test_streaming_peers_run_as_their_users_run_them():
  # benchmarks/streaming_throughput.py's PySpark rows, a second of events
  # each, the two side by side (a JVM each: their start-up is the cost):
  # the default row's key UDF is Arrow-evaluated in Python workers that
  # have pyarrow (Spark 4's default with pyspark[sql]), the second row's
  # pickled; run_once fails a run whose plan shows otherwise.
  from concurrent.futures import ThreadPoolExecutor
  from benchmarks import streaming_throughput as st
  rate, seconds = 1000, 1
  load = os.getloadavg()[0]
  variants = {'pyspark': ('ArrowEvalPython', 'true'),
              'pyspark-pickled': ('BatchEvalPython', 'false')}
  with ThreadPoolExecutor(len(variants)) as pool:
    runs = {v: pool.submit(st.run_once, v, rate, seconds, 0, 'local[2]',
                           sys.executable, []) for v in variants}
    runs = {v: run.result() for v, run in runs.items()}
  rows = []
  for variant, (evaluated, arrow) in variants.items():
    stats = runs[variant]
    assert stats['udf_eval'] == evaluated, stats['log_tail']
    assert stats['arrow_enabled'] == arrow
    assert stats['worker'].startswith(sys.executable + ' pyarrow ')
    assert stats['panes'] and all(n > 0 for _, _, n in stats['panes'])
    # Its row parses, counted in time or not (this machine may be busy).
    row = st.summarize(stats, rate, seconds, 0, variant)
    row.update(variant=variant, rate=rate, load_before=load,
               load_after=os.getloadavg()[0], kept_up=row.get('kept_up'))
    rows.append(row)
  header, rule, *lines = st.table(rows)
  assert len(lines) == 2
  for variant, line in zip(variants, lines):
    assert line.count('|') == header.count('|') == rule.count('|')
    assert line.startswith(f'| 1,000 | {st.LABELS[variant]} | ')


def test_streaming_profile_fits_fixed_and_per_event_costs():
  # Two steady runs whose micro-batches cost 300 ms + 2 us an event of
  # wall time and 400 CPU-ms + 5 CPU-us an event: the line through them
  # gives those back.
  from benchmarks import streaming_profile as sp

  def run(rate):
    events = 0.3 * rate / (1 - 2e-6 * rate)  # steady: a batch reads its own
    secs = 0.3 + 2e-6 * events               # duration's events
    ends = [(100 + 8 + i * secs, secs) for i in range(1, 11)]
    cpu = [(100 + t / 1000, (0.4 / secs + 5e-6 * rate) * t / 1000)
           for t in range(0, 20000)]
    # Each micro-batch's timer wave fires the windows it counted.
    panes = [(at - 1, at - 0.01, events) for at, _ in ends]
    return sp.steady({'start': 100, 'micro_batches': ends, 'cpu': cpu,
                      'panes': panes}, rate, 30, 8)
  low, high = run(50000), run(100000)
  assert low['batches'] == high['batches'] == 9
  # Before the events (at 100 s), micro-batches of 250 ms that read
  # nothing, at 0.3 CPU-s each.
  quiet = sp.idle({'start': 100,
                   'micro_batches': [(90 + i / 4, 0.25) for i in range(20)],
                   'cpu': [(90 + t / 100, 0.3 * 4 * t / 100)
                           for t in range(2000)]})
  assert quiet['idle_batches'] == 19
  assert quiet['idle_batch_ms'] == 250
  assert abs(quiet['idle_cpu_ms_per_batch'] - 300) < 5
  fixed, per_event = sp.fit(low, high, 'batch_ms')
  assert abs(fixed - 300) < 1 and abs(per_event - 2e-3) < 1e-5
  fixed_cpu, per_event_cpu = sp.fit(low, high, 'cpu_ms_per_batch')
  assert abs(fixed_cpu - 400) < 5 and abs(per_event_cpu - 5e-3) < 1e-4
