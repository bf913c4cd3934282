"""The pipeline proto as fusion should see it: a copy, rewritten.

Pure proto work before Beam's fusion phases (plan.fuse): no Spark, no
gRPC.
"""

from __future__ import annotations

import copy

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners import pipeline_utils

from beam_pyspark.planning import reshuffles


def normalized(
    pipeline: beam_runner_api_pb2.Pipeline) -> beam_runner_api_pb2.Pipeline:
  """A copy of ``pipeline``: its identical environments merged, its
  recoding Reshuffles expanded."""
  pipeline = copy.deepcopy(pipeline)
  # Identical environments as one, as Beam's FnApiRunner and Python SDK do
  # (pipeline_utils): fusion fuses only within one environment id, so 150
  # ParDos each in its own copy of one environment were 150 stages, which
  # Spark chained into one task function nested 150 deep that its pickler
  # refused ("excessively deep recursion required"). The id kept is one of
  # the pipeline's own: stages' environments are still found in it.
  pipeline_utils.merge_common_environments(pipeline, inplace=True)
  reshuffles.expand_recoding(pipeline)
  return pipeline
