"""Pipelines the hardening issue found failing through the job server, sent
by Beam's own PortableRunner client to a real job-server subprocess."""

from __future__ import annotations

import glob
import os

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions

from jobserver_process import JobServerProcess
from test_semantics_reshuffle import _KeyBy

EMBEDDED = 'beam:env:embedded_python:v1'
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  # The job's user modules (key_types) are importable by the server's
  # workers, as a user's installed package would be.
  # Spark warmed up at start, as by default: the first job is submitted
  # while the warm-up runs.
  s = JobServerProcess(tmp_path_factory.mktemp('jobserver'),
                       env={'PYTHONPATH': TESTS}, spark_warm_up=True)
  yield s
  s.stop()


def _options(server):
  return PipelineOptions([
      '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
      f'--environment_type={EMBEDDED}'])


def test_namedtuple_keys_through_reshuffle_and_group(server, tmp_path):
  # Defect 10: "Unknown type tag 80" in the stage reading the Reshuffle.
  out = str(tmp_path / 'out')
  with beam.Pipeline(options=_options(server)) as p:
    _ = (p | beam.Create(range(6)) | beam.ParDo(_KeyBy('namedtuple'))
         | beam.Reshuffle() | beam.GroupByKey()
         | beam.MapTuple(lambda k, vs: f'{tuple(k)} {sorted(vs)}')
         | beam.io.WriteToText(out))
  lines = sorted(line.strip() for path in glob.glob(out + '*')
                 for line in open(path, encoding='utf-8'))
  assert lines == ["(0, 'x') [0, 2, 4]", "(1, 'x') [1, 3, 5]"]


def test_source_metrics_under_beams_step_names(server):
  # Defect 11, through GetJobMetrics.
  from apache_beam.io.iobase import Read
  from apache_beam.io.utils import CountingSource
  p = beam.Pipeline(options=_options(server))
  _ = p | Read(CountingSource(100)) | beam.Map(lambda x: x)
  result = p.run()
  result.wait_until_finish()
  counters = {
      (c.key.step, c.key.metric.name): c.committed
      for c in result.metrics().query(MetricsFilter())['counters']
  }
  assert counters.get(
      ('Read/SDFBoundedSourceReader/ParDo(SDFBoundedSourceDoFn)/Process',
       'recordsRead')) == 100, counters


def test_the_server_started_spark_before_its_first_job(server):
  """By default the job server starts Spark (its SQL session and the
  streaming source too) when it starts, in the background; the jobs above
  were submitted while it did, and ran on it."""
  import time  # pylint: disable=import-outside-toplevel
  deadline = time.monotonic() + 180  # its throwaway query may still run
  while True:
    with open(server.log_path, encoding='utf-8', errors='replace') as f:
      log = f.read()
    if ('Spark is started and warmed up for jobs' in log or
        time.monotonic() > deadline):
      break
    time.sleep(0.5)
  assert 'Spark is started and warmed up for jobs' in log, log[-5000:]
  assert 'Could not start Spark ahead' not in log
