"""Spark's UI names what Beam runs: job descriptions and stage names.

Read through Spark's own REST API (``/api/v1/applications/<app>/...``) of
the context the runner used, for a batch WordCount and a streaming job.
"""

from __future__ import annotations

import json
import urllib.request

import apache_beam as beam
from apache_beam.testing.test_stream import TestStream as Events
from apache_beam.transforms import window
from pyspark import SparkContext

from conftest import spark_options


def _rest(path: str):
  sc = SparkContext.getOrCreate()
  assert sc.uiWebUrl, 'the Spark UI is off in this context'
  url = f'{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/{path}'
  with urllib.request.urlopen(url, timeout=30) as reply:
    return json.load(reply)


def _of_job(job_id: str):
  """(descriptions, stage names) of the Spark jobs of Beam job ``job_id``."""
  jobs = [j for j in _rest('jobs')
          if f'Beam job {job_id}' in (j.get('description') or '')]
  stage_ids = {s for j in jobs for s in j['stageIds']}
  stages = [s['name'] for s in _rest('stages') if s['stageId'] in stage_ids]
  return [j['description'] for j in jobs], stages


def test_wordcount_spark_jobs_and_stages_are_named_by_beam_stages(tmp_path):
  lines = ['the quick brown fox', 'the lazy dog'] * 20
  p = beam.Pipeline(options=spark_options(no_fast_path=True))
  _ = (p | beam.Create(lines) | 'Split' >> beam.FlatMap(str.split)
       | 'PairWithOne' >> beam.Map(lambda w: (w, 1))
       | 'GroupAndSum' >> beam.CombinePerKey(sum)
       | 'Format' >> beam.MapTuple(lambda w, c: f'{w}: {c}')
       | 'Write' >> beam.io.WriteToText(str(tmp_path / 'counts')))
  result = p.run()
  result.wait_until_finish()
  descriptions, stages = _of_job(result.job_id)
  assert descriptions, 'no Spark job described as this Beam job'
  text = '\n'.join(descriptions)
  for name in ('Split', 'PairWithOne', 'GroupAndSum'):
    assert name in text, (name, descriptions)
  # Every Spark stage is named after Beam's, none by a runner call site.
  assert stages and all(s.startswith('Beam ') for s in stages), stages
  assert not [s for s in stages if 'beam_pyspark/' in s], stages
  assert any('GroupAndSum' in s and 'shuffle write' in s for s in stages), (
      stages)


def test_streaming_micro_batches_are_named_with_their_stages():
  stream = (Events().add_elements([window.TimestampedValue('a', 1)])
            .advance_watermark_to(20)
            .add_elements([window.TimestampedValue('b', 21)])
            .advance_watermark_to_infinity())
  p = beam.Pipeline(options=spark_options(streaming=True))
  _ = (p | stream | 'Window' >> beam.WindowInto(window.FixedWindows(10))
       | 'Key' >> beam.Map(lambda w: (w, 1))
       | 'Count' >> beam.CombinePerKey(sum))
  result = p.run()
  result.wait_until_finish()
  descriptions, stages = _of_job(result.job_id)
  batches = [d for d in descriptions if ', micro-batch ' in d]
  assert batches, descriptions
  assert any('Count' in d for d in batches), batches
  assert not [s for s in stages if 'beam_pyspark/' in s], stages
  # Every stage named by Beam: no PySpark call site of the foreachBatch
  # thread ("call at .../py4j/clientserver.py:644").
  assert not [s for s in stages if not s.startswith('Beam ')], stages
