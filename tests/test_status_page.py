"""The status page: fixed routes over the job registry, real HTTP.

(Browser tests come with the page's live parts; these check what the
server answers.)"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from beam_pyspark.events import JobState
from beam_pyspark.jobservice.jobs import JobRegistry
from beam_pyspark.planning import plan_pipeline
from beam_pyspark.web.graph import pipeline_svg
from beam_pyspark.web.server import StatusPages
from beam_pyspark.web.server import StatusServer
from test_registry import Executor
from test_registry import _pipeline


@pytest.fixture
def site():
  executor = Executor()
  registry = JobRegistry(executor)
  server = StatusServer(StatusPages(
      registry, plan_svg=lambda p: pipeline_svg(plan_pipeline(p)))).start()
  yield registry, executor, server
  server.stop()


def _get(url):
  with urllib.request.urlopen(url, timeout=10) as response:
    return response.status, response.headers['Content-Type'], response.read()


def test_jobs_are_listed_newest_first_with_state_and_duration(site):
  registry, executor, server = site
  first = registry.prepare('first<script>', _pipeline(), {}).job_id
  registry.run(first)
  executor.executions[first].emit(JobState.DONE)
  second = registry.prepare('second', _pipeline(), {}).job_id
  status, kind, body = _get(server.url)
  page = body.decode()
  assert status == 200 and kind.startswith('text/html')
  assert page.index('second') < page.index('first')
  assert '&lt;script&gt;' in page and '<script>' not in page
  assert 'DONE' in page and 'STOPPED' in page
  status, kind, body = _get(server.url + 'api/jobs')
  rows = json.loads(body)
  assert [r['job_id'] for r in rows] == [second, first]
  assert rows[1]['state'] == 'DONE' and rows[1]['duration_secs'] >= 0
  assert rows[0]['duration_secs'] is None


def test_a_jobs_page_shows_its_stages_and_messages(site):
  registry, executor, server = site
  job_id = registry.prepare('one', _pipeline(), {}).job_id
  registry.run(job_id)
  executor.executions[job_id].say('halfway <there>')
  status, _, body = _get(server.url + 'jobs/' + job_id)
  page = body.decode()
  assert status == 200
  assert '<svg' in page and 'Map(str)' in page
  assert 'halfway &lt;there&gt;' in page
  assert 'RUNNING' in page


def test_unknown_routes_and_jobs_are_404(site):
  _, _, server = site
  for path in ['nope', 'jobs/nope', '../etc/passwd', 'jobs/']:
    with pytest.raises(urllib.error.HTTPError) as info:
      _get(server.url + path)
    assert info.value.code == 404


def test_only_get_and_a_bounded_request_line(site):
  _, _, server = site
  request = urllib.request.Request(server.url, data=b'x', method='POST')
  with pytest.raises(urllib.error.HTTPError) as info:
    urllib.request.urlopen(request, timeout=10)
  assert info.value.code == 405
  with socket.create_connection(('localhost', server.port), timeout=10) as s:
    s.sendall(b'GET /' + b'a' * 10000 + b' HTTP/1.1\r\n\r\n')
    assert b' 414 ' in s.recv(1000).split(b'\r\n')[0]
  # Still serving.
  assert _get(server.url)[0] == 200


def test_the_job_server_serves_the_page(tmp_path):
  from jobserver_process import JobServerProcess
  from apache_beam.portability.api import beam_job_api_pb2
  server = JobServerProcess(tmp_path / 'server')
  try:
    assert server.status_url and server.status_url.startswith('http://')
    prepared = server.job_stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
        pipeline=_pipeline(), job_name='visible'))
    rows = json.loads(_get(server.status_url + 'api/jobs')[2])
    assert [(r['job_id'], r['state']) for r in rows] == [
        (prepared.preparation_id, 'STOPPED')]
    page = _get(server.status_url + 'jobs/' + prepared.preparation_id)[2]
    assert b'<svg' in page
  finally:
    server.stop()


def test_the_runner_serves_its_own_jobs_when_asked(tmp_path):
  import apache_beam as beam
  from conftest import spark_options
  from beam_pyspark import runner
  with beam.Pipeline(options=spark_options(status_port=0,
                                           job_name='mine')) as p:
    _ = p | beam.Create([1, 2]) | beam.Map(str)
  url = runner.status_page()
  rows = json.loads(_get(url + 'api/jobs')[2])
  mine = [r for r in rows if r['job_name'] == 'mine']
  assert mine and mine[0]['state'] == 'DONE'
  assert b'<svg' in _get(url + 'jobs/' + mine[0]['job_id'])[2]


def test_health_and_readiness(site):
  registry, _, server = site
  assert _get(server.url + 'healthz')[0] == 200
  assert _get(server.url + 'readyz')[0] == 200
  registry.shutdown(0, 'The test stops the server')
  with pytest.raises(urllib.error.HTTPError) as error:
    _get(server.url + 'readyz')
  assert error.value.code == 503
  assert _get(server.url + 'healthz')[0] == 200  # still answering


def _scrape(url):
  """Prometheus' text format: {(name, frozenset of labels): value}; the
  HELP/TYPE lines checked on the way."""
  import re
  status, content_type, body = _get(url + 'metrics')
  assert status == 200 and content_type.startswith('text/plain; version=0.0.4')
  samples, typed = {}, set()
  for line in body.decode('utf-8').splitlines():
    if line.startswith('# TYPE '):
      typed.add(line.split()[2])
      continue
    if line.startswith('#'):
      continue
    m = re.fullmatch(r'(\w+)(?:\{(.*)\})? (\S+)', line)
    assert m, f'not a sample line: {line!r}'
    labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ''))
    assert m.group(1) in typed, f'{m.group(1)} has no TYPE line'
    samples[(m.group(1), labels)] = float(m.group(3))
  return samples


def test_metrics_endpoint_matches_the_jobs_own_metrics(tmp_path):
  import apache_beam as beam
  from apache_beam.metrics import Metrics
  from apache_beam.metrics.metric import MetricsFilter
  from conftest import spark_options
  from beam_pyspark import runner

  class Measure(beam.DoFn):
    def __init__(self):
      self.seen = Metrics.counter('page', 'seen "quoted"')
      self.sizes = Metrics.distribution('page', 'sizes')

    def process(self, element):
      self.seen.inc()
      self.sizes.update(element)
      yield element

  p = beam.Pipeline(options=spark_options(status_port=0, job_name='scraped'))
  _ = p | beam.Create([1, 5, 7]) | beam.ParDo(Measure())
  result = p.run()
  result.wait_until_finish()
  samples = _scrape(runner.status_page())
  job = result.job_id
  counters = result.metrics().query(MetricsFilter().with_namespace('page'))
  (counter,) = counters['counters']
  (dist,) = counters['distributions']

  def user(name, metric):
    return [v for (n, labels), v in samples.items() if n == name and
            ('job', job) in labels and ('name', metric) in labels]

  assert user('beam_pyspark_user_counter', 'seen \\"quoted\\"') == [
      counter.committed] == [3]
  assert user('beam_pyspark_user_distribution_sum', 'sizes') == [
      dist.committed.sum]
  assert user('beam_pyspark_user_distribution_max', 'sizes') == [7]
  elements = [v for (n, labels), v in samples.items()
              if n == 'beam_pyspark_elements' and ('job', job) in labels]
  assert elements and max(elements) == 3
  assert samples[('beam_pyspark_jobs', frozenset({('state', 'DONE')}))] >= 1


def test_the_job_port_answers_grpc_health_checks(tmp_path):
  import grpc
  from jobserver_process import JobServerProcess
  from beam_pyspark.jobservice import health
  server = JobServerProcess(tmp_path / 'server')
  try:
    check = server.channel.unary_unary(
        '/grpc.health.v1.Health/Check',
        request_serializer=health.HealthCheckRequest.SerializeToString,
        response_deserializer=health.HealthCheckResponse.FromString)
    assert check(health.HealthCheckRequest(), timeout=10).status == (
        health.SERVING)
    assert check(health.HealthCheckRequest(service=health.JOB_SERVICE),
                 timeout=10).status == health.SERVING
    with pytest.raises(grpc.RpcError) as error:
      check(health.HealthCheckRequest(service='nope'), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
  finally:
    server.stop()


def test_health_turns_not_serving_and_watch_follows():
  import threading
  from concurrent import futures
  import grpc
  from beam_pyspark.jobservice import health
  serving, stopped = [True], threading.Event()
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
  server.add_generic_rpc_handlers(
      (health.health_handler(lambda: serving[0], stopped),))
  port = server.add_insecure_port('localhost:0')
  server.start()
  try:
    with grpc.insecure_channel(f'localhost:{port}') as channel:
      watch = channel.unary_stream(
          '/grpc.health.v1.Health/Watch',
          request_serializer=health.HealthCheckRequest.SerializeToString,
          response_deserializer=health.HealthCheckResponse.FromString)
      updates = watch(health.HealthCheckRequest(), timeout=30)
      assert next(updates).status == health.SERVING
      serving[0] = False  # the registry started closing
      assert next(updates).status == health.NOT_SERVING
      updates.cancel()
  finally:
    stopped.set()
    server.stop(None)
