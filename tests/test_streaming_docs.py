"""The streaming guide's unbounded splittable DoFn, as the guide shows it.

Beam's Python SDK resumes a splittable DoFn later through
``tracker.defer_remainder(delay)`` (its form of ProcessContinuation.resume):
the example is taken from docs/guide/streaming.md itself and run on the
streaming engine, where each resumed remainder runs in a later
micro-batch, once its delay has passed.
"""
import os
import re

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to

from conftest import spark_options

GUIDE = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'docs', 'guide', 'streaming.md')


def _guide_example() -> dict:
  """The guide's code block that defines PollTwoAtATime, executed."""
  with open(GUIDE, encoding='utf-8') as f:
    text = f.read()
  blocks = re.findall(r'```python\n(.*?)```', text, re.DOTALL)
  (code,) = [b for b in blocks if 'class PollTwoAtATime' in b]
  assert 'defer_remainder' in code
  namespace = {'__name__': 'guide_example'}
  exec(compile(code, GUIDE, 'exec'), namespace)  # pylint: disable=exec-used
  return namespace


def test_the_guides_self_checkpointing_read_runs_over_micro_batches():
  example = _guide_example()
  with beam.Pipeline(options=spark_options(streaming=True)) as p:
    out = p | beam.Create([6]) | beam.ParDo(example['PollTwoAtATime']())
    assert_that(out, equal_to(list(range(6))))
  batches = p.result.metrics().query(
      MetricsFilter().with_namespace('beam_pyspark.streaming')
      .with_name('micro_batches'))['counters']
  # Two records a call, then half a second's wait: the three calls ran in
  # micro-batches of their own.
  assert sum(c.committed for c in batches) >= 3, batches
