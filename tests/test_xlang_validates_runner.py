"""Beam's cross-language ValidatesRunner suite on this runner.

``apache_beam.transforms.validate_runner_xlang_test.ValidateRunnerXlangTest``
is what Beam runs against its Flink, Spark and Dataflow runners to certify
multi-language support: Python pipelines whose ParDo (one input and output;
several inputs and outputs with a side input), GroupByKey, CoGroupByKey,
Combine (globally, per key), Flatten and Partition are Java transforms,
expanded by a Java expansion service and run in Beam's Java harness, their
PCollections crossing between the SDKs at every boundary.

Beam builds that suite's expansion service from its repository and
publishes none; sdks/xlang/validates (`make sdk-xlang`) answers the same
URNs with Java's own transforms (its registrar is written from what the
suite asserts). The suite reads the service's port from EXPANSION_PORT, as
Beam's Gradle tasks give it.
"""

from __future__ import annotations

import os

from apache_beam.transforms import validate_runner_xlang_test as beam_xlang

from beam_pyspark.local.expansion import ExpansionService
from beam_suites import OnPySpark


class ValidateRunnerXlangOnPySpark(OnPySpark,
                                   beam_xlang.ValidateRunnerXlangTest):
  """Beam's class unchanged, its pipelines on PySparkRunner (local Spark).
  (Its gbek sibling, ValidateRunnerGBEKTest, needs Google's Secret Manager
  and is not run.)"""

  # Beam decides its skip ("EXPANSION_PORT environment var is not
  # provided") when its module is imported, before setUpClass starts the
  # service and sets the port: the port is set below, so the class runs.
  __unittest_skip__ = False

  @classmethod
  def setUpClass(cls):
    import tempfile
    cls._logs = tempfile.mkdtemp(prefix='xvr-')
    cls._service = ExpansionService('validates', cls._logs)
    cls._saved_port = os.environ.get('EXPANSION_PORT')
    os.environ['EXPANSION_PORT'] = str(cls._service.port)
    super().setUpClass()

  @classmethod
  def tearDownClass(cls):
    super().tearDownClass()
    if cls._saved_port is None:
      os.environ.pop('EXPANSION_PORT', None)
    else:
      os.environ['EXPANSION_PORT'] = cls._saved_port
    cls._service.stop()
