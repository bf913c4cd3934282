"""Slow pipelines for the status page's live tests (not a test module).

Importable by a job server's workers (its PYTHONPATH holds tests/), as a
user's installed package would be: the DoFn is pickled by reference.
"""

from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

import beam_pyspark.options  # noqa: F401  (registers --spark_parallelism)

EMBEDDED = 'beam:env:embedded_python:v1'


class Slow(beam.DoFn):
  """Sleeps ``secs`` per element and counts it (status/slow_elements)."""
  def __init__(self, secs: float):
    self.secs = secs
    self.seen = Metrics.counter('status', 'slow_elements')

  def process(self, element):
    time.sleep(self.secs)
    self.seen.inc()
    yield element


def portable_options(job_endpoint: str, job_name: str,
                     parallelism: int) -> PipelineOptions:
  return PipelineOptions([
      '--runner=PortableRunner', f'--job_endpoint={job_endpoint}',
      f'--environment_type={EMBEDDED}', f'--job_name={job_name}',
      f'--spark_parallelism={parallelism}'])


def slow_pipeline(options: PipelineOptions, elements: int,
                  secs: float) -> beam.Pipeline:
  """Numbers spread over the job's partitions, each slept on: one Spark
  task per partition, so tasks end one by one while the job runs."""
  p = beam.Pipeline(options=options)
  _ = (p | 'Numbers' >> beam.Create(list(range(elements)))
       | 'Spread' >> beam.Reshuffle()
       | 'Slowly' >> beam.ParDo(Slow(secs))
       | 'Format' >> beam.Map(str))
  return p
