"""Beam's own test suites run on this runner: the shared set-up.

Beam's ``TestPipeline`` takes its runner from ``--test-pipeline-options``
(``TestPipeline.pytest_test_pipeline_options`` under pytest), and a test
that passes its own options gets Beam's default runner
(``StandardOptions.DEFAULT_RUNNER``): a suite class that mixes in
``OnPySpark`` points both at ``PySparkRunner`` (local Spark) for its tests,
and restores them after. Not a test module.
"""
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.options.pipeline_options import StandardOptions
from apache_beam.testing import test_pipeline

RUNNER = 'beam_pyspark.PySparkRunner'


class OnPySpark:
  @classmethod
  def setUpClass(cls):
    cls._saved = (test_pipeline.TestPipeline.pytest_test_pipeline_options,
                  StandardOptions.DEFAULT_RUNNER)
    test_pipeline.TestPipeline.pytest_test_pipeline_options = (
        f'--runner={RUNNER}')
    StandardOptions.DEFAULT_RUNNER = RUNNER
    super().setUpClass()

  @classmethod
  def tearDownClass(cls):
    super().tearDownClass()
    (test_pipeline.TestPipeline.pytest_test_pipeline_options,
     StandardOptions.DEFAULT_RUNNER) = cls._saved

  def test_pipelines_run_on_pyspark(self):
    """The suite's pipelines, with or without their own options, are ours."""
    from beam_pyspark import PySparkRunner
    for pipeline in (test_pipeline.TestPipeline(),
                     test_pipeline.TestPipeline(
                         options=PipelineOptions(streaming=True)),
                     beam.Pipeline(options=PipelineOptions())):
      self.assertIsInstance(pipeline.runner, PySparkRunner)
