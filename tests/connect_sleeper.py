"""A job that runs until it is stopped, over Spark Connect (not a test
module): ``python connect_sleeper.py sc://HOST:PORT MARKER`` runs a
GroupByKey whose DoFn writes MARKER (the server is on this machine) and
then sleeps ten minutes, so that a test can kill the server mid-job
(tests/test_connect_failures.py)."""

import sys
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions


class Sleep(beam.DoFn):
  def __init__(self, marker: str):
    self.marker = marker

  def process(self, element):
    with open(self.marker, 'a', encoding='utf-8') as f:
      f.write(f'{element}\n')
    time.sleep(600)
    yield element


def main(url: str, marker: str) -> None:
  options = PipelineOptions(['--runner=beam_pyspark.PySparkRunner',
                             f'--spark_remote={url}'])
  with beam.Pipeline(options=options) as p:
    _ = (p | beam.Create([('a', 1), ('b', 2)]) | beam.GroupByKey()
         | beam.ParDo(Sleep(marker)))


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2])
