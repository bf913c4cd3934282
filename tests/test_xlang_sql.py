"""Beam SQL in a Python pipeline: a multi-language pipeline whose SQL stage
runs in Beam's Java harness and whose Python stages stay embedded.

Python's ``SqlTransform`` is expanded by Beam's Java expansion service
(Beam 2.71.0 from Maven Central, started by scripts/expansion-service.sh,
`make sdk-xlang`), which gives the Java transforms a PROCESS environment
(``python -m beam_pyspark.boot java``) whose artifacts are its own jars.
The runner stages those, and each Java harness retrieves them over the Fn
API. The query's rows must equal the same GROUP BY written in Python and
run on Beam's DirectRunner, on PySparkRunner (local[2]) and through the
job server with Beam's PortableRunner.
"""

from __future__ import annotations

import glob
import json

import pytest

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.transforms.sql import SqlTransform

from beam_pyspark.local.expansion import ExpansionService
from jobserver_process import JobServerProcess

SALES = [
    ('apple', 3, 1.5), ('pear', 1, 0.75), ('apple', 2, 1.25),
    ('plum', 7, 0.5), ('pear', 4, 1.0), ('apple', 1, 2.0),
    ('fig', 5, 3.0), ('plum', 2, 0.25),
] * 5

QUERY = """
  SELECT item, COUNT(*) AS sales, SUM(units) AS units, MAX(price) AS top
  FROM PCOLLECTION
  GROUP BY item
"""


@pytest.fixture(scope='module')
def sql_service(tmp_path_factory):
  service = ExpansionService('sql', str(tmp_path_factory.mktemp('sql')))
  yield service
  service.stop()


def make_rows(p):
  return (
      p
      | 'Sales' >> beam.Create(SALES)
      | 'ToRows' >> beam.Map(
          lambda s: beam.Row(item=s[0], units=s[1], price=s[2])))


def write(rows, path: str):
  _ = (
      rows
      | 'Format' >> beam.Map(lambda r: json.dumps(
          [r.item, int(r.sales), int(r.units), float(r.top)]))
      | 'Write' >> beam.io.WriteToText(path))


def read(path: str) -> list:
  lines = []
  for name in glob.glob(path + '*'):
    with open(name, encoding='utf-8') as f:
      lines.extend(json.loads(line) for line in f if line.strip())
  return sorted(lines)


@pytest.fixture(scope='module')
def expected(tmp_path_factory):
  """The same GROUP BY in Python, on Beam's DirectRunner."""
  out = str(tmp_path_factory.mktemp('direct') / 'rows')
  with beam.Pipeline('DirectRunner') as p:
    per_item = (
        make_rows(p)
        | beam.GroupBy('item').aggregate_field(
            'item', beam.combiners.CountCombineFn(), 'sales').aggregate_field(
                'units', sum, 'units').aggregate_field('price', max, 'top'))
    write(per_item, out)
  rows = read(out)
  assert len(rows) == 4
  return rows


def sql_pipeline(options, service, out: str) -> beam.Pipeline:
  p = beam.Pipeline(options=options)
  rows = make_rows(p) | 'Sql' >> SqlTransform(
      QUERY, expansion_service=service.address)
  write(rows, out)
  return p


def check_environments(p: beam.Pipeline) -> None:
  """The SQL stage's environment is Java's PROCESS boot, its artifacts the
  expansion service's jars; the Python transforms keep Python's."""
  proto = p.to_runner_api()
  envs = proto.components.environments
  java_ids = [
      env_id for env_id, e in envs.items()
      if e.urn == common_urns.environments.PROCESS.urn and
      beam_runner_api_pb2.ProcessPayload.FromString(e.payload).command ==
      'python -m beam_pyspark.boot java'
  ]
  assert len(java_ids) == 1, envs
  java_id = java_ids[0]
  jars = envs[java_id].dependencies
  assert len(jars) > 40  # the expansion service's classpath
  names = {
      beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(
          a.role_payload).staged_name for a in jars
  }
  assert any(n.startswith('beam-sdks-java-harness-2.71.0') for n in names)
  assert any(n.startswith('beam-sdks-java-extensions-sql-2.71.0')
             for n in names)
  by_env = {}
  for t in proto.components.transforms.values():
    if not t.subtransforms and t.environment_id:
      by_env.setdefault(t.environment_id, []).append(t.unique_name)
  assert all(n.startswith('Sql/') for n in by_env[java_id])
  assert any(n.startswith('ToRows') for env, names in by_env.items()
             if env != java_id for n in names)


def test_sql_group_by_on_pyspark_runner(sql_service, expected, tmp_path):
  out = str(tmp_path / 'rows')
  p = sql_pipeline(
      PipelineOptions([
          '--runner=beam_pyspark.PySparkRunner',
          '--spark_master_url=local[2]',
      ]), sql_service, out)
  check_environments(p)
  p.run().wait_until_finish()
  assert read(out) == expected


@pytest.fixture(scope='module')
def job_server(tmp_path_factory):
  server = JobServerProcess(tmp_path_factory.mktemp('sqljs') / 'artifacts')
  yield server
  server.stop()


def test_sql_group_by_through_the_job_server(
    sql_service, job_server, expected, tmp_path):
  out = str(tmp_path / 'rows')
  p = sql_pipeline(
      PipelineOptions([
          '--runner=PortableRunner',
          f'--job_endpoint={job_server.job_endpoint}',
          '--environment_type=beam:env:embedded_python:v1',
      ]), sql_service, out)
  result = p.run()
  assert result.wait_until_finish() == 'DONE'
  assert read(out) == expected
