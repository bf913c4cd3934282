"""The status page: fixed routes over the job registry, real HTTP.

These check what the server answers, over a registry with a fake executor
(no Spark) where a test says so; test_status_live.py runs real jobs, and
test_status_browser.py drives the pages in a real browser."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request

import pytest

from beam_pyspark.events import Importance
from beam_pyspark.events import JobState
from beam_pyspark.jobservice.jobs import JobRegistry
from beam_pyspark.planning import plan_pipeline
from beam_pyspark.web.server import StatusPages
from beam_pyspark.web.server import StatusServer
from test_registry import Executor
from test_registry import _pipeline


@pytest.fixture
def site():
  executor = Executor()
  registry = JobRegistry(executor)
  server = StatusServer(StatusPages(registry)).start()
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
  assert 'first&lt;script&gt;' in page and 'first<script>' not in page
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
  page = _get(url + 'jobs/' + mine[0]['job_id'])[2].decode()
  assert b'<svg' in page.encode() and '<h1>mine</h1>' in page
  # Its real first state, the master Spark ran and the options set.
  detail = json.loads(_get(url + 'api/jobs/' + mine[0]['job_id'])[2])
  assert [s['label'] for s in detail['states']][:2] == ['PREPARED', 'STARTING']
  # The context the job ran on: the test's (local[2]), or one an earlier
  # test of this process left running (whose master the job then used).
  from pyspark import SparkContext
  from beam_pyspark.spark.session import master_info
  ran = master_info(SparkContext._active_spark_context)  # pylint: disable=protected-access
  assert ran['master'].startswith('local[') and ran['cores'] >= 1, ran
  assert detail['spark_master'] == ran
  assert f"{ran['master']} ({ran['cores']} cores)" in page
  assert set(detail['options_set']) == {
      'job_name', 'runner', 'spark_master_url', 'status_port'}, detail[
          'options_set']


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


# -- progress, a job's page, its JSON, cancel --------------------------------


class ReportingExecution:
  """What PipelineExecution reports besides states: the engine's progress,
  metrics and (for streaming engines) status, set by the test."""
  def __init__(self, fake):
    self.fake = fake
    self.progress_value = None
    self.streaming_value = None

  def __getattr__(self, name):
    return getattr(self.fake, name)

  def progress(self):
    return self.progress_value

  def streaming_status(self):
    return self.streaming_value

  def drain(self):
    # As PipelineExecution.drain: only a streaming engine drains.
    if self.streaming_value is None:
      return False
    self.fake.emit(JobState.DRAINING)
    self.fake.emit(JobState.DRAINED)
    return True


@pytest.fixture
def live_site(site):
  registry, executor, server = site
  wrapped = {}

  def invoke(job_id, pipeline, options, listener):
    wrapped[job_id] = ReportingExecution(
        executor(job_id, pipeline, options, listener))
    return wrapped[job_id]

  return registry, invoke, wrapped, server


def _progress(done, total, beam_stages=None):
  return {'tasks_done': done, 'tasks_total': total, 'tasks_active': 1,
          'tasks_failed': 0, 'spark_ui': 'http://driver:4040',
          'stages': [{'stage_id': 3, 'attempt': 0, 'name': 'foreach at x.py',
                      'total': total, 'done': done, 'active': 1, 'failed': 0,
                      'url': 'http://driver:4040/stages/stage/?id=3&attempt=0'}],
          'beam_stages': beam_stages or {}}


def test_the_list_shows_each_jobs_task_progress(live_site):
  registry, invoke, wrapped, server = live_site
  job_id = registry.prepare('busy', _pipeline(), {}).job_id
  registry.run(job_id, invoke=invoke)
  wrapped[job_id].progress_value = _progress(3, 12)
  (row,) = json.loads(_get(server.url + 'api/jobs')[2])
  assert row['progress'] == {'done': 3, 'total': 12, 'active': 1,
                             'failed': 0, 'fraction': 0.25}
  page = _get(server.url)[2].decode()
  assert 'data-done="3" data-total="12"' in page and '3/12 tasks' in page
  assert "fetch('/api/jobs'" in page  # refreshed by its script
  wrapped[job_id].progress_value = _progress(7, 12)
  (row,) = json.loads(_get(server.url + 'api/jobs')[2])
  assert row['progress']['done'] == 7


def test_an_ended_job_keeps_its_last_progress(live_site):
  registry, invoke, wrapped, server = live_site
  job_id = registry.prepare('ends', _pipeline(), {}).job_id
  registry.run(job_id, invoke=invoke)
  wrapped[job_id].progress_value = _progress(11, 12)
  wrapped[job_id].fake.emit(JobState.DONE)
  wrapped[job_id].progress_value = None  # the engine is gone
  (row,) = json.loads(_get(server.url + 'api/jobs')[2])
  # DONE reads complete: Spark's tracker hears of the last task late.
  assert row['progress']['done'] == row['progress']['total'] == 12


def _counter(name, value, step='s1'):
  from apache_beam.metrics import monitoring_infos as mi
  return mi.int64_user_counter('ns', name, value, ptransform=step)


def test_a_jobs_page_has_its_metrics_stages_options_and_artifacts(
    live_site, tmp_path):
  from apache_beam.metrics import monitoring_infos as mi
  from apache_beam.metrics.cells import GaugeData
  from jobserver_process import file_dependency
  from jobserver_process import pipeline_with_dependencies
  registry, invoke, wrapped, server = live_site
  pipeline = pipeline_with_dependencies(
      [file_dependency(str(tmp_path / 'dep.whl'), 'dep<1>.whl')])
  job_id = registry.prepare(
      'detailed', pipeline, {'beam:option:spark_parallelism:v1': 7,
                             'beam:option:note:v1': '<b>bold</b>'}).job_id
  registry.run(job_id, invoke=invoke)
  execution = wrapped[job_id]
  execution.fake.committed_metrics = [
      _counter('seen<x>', 5),
      mi.int64_user_distribution('ns', 'sizes', mi.DistributionData(
          12, 3, 1, 7), ptransform='s1'),
      mi.int64_user_gauge('ns', 'level', GaugeData(42), ptransform='s1'),
  ]
  execution.fake.attempted_metrics = [_counter('seen<x>', 6)]
  execution.progress_value = _progress(2, 4)
  execution.streaming_value = {
      'watermarks': {'stage<1>': '2026-01-01T00:00:00Z'},
      'endpoints': {'src': {'grant': 10, 'backlog': 3}},
      'micro_batches': [{'batch': 0, 'secs': 0.4}]}
  execution.fake.say('a warning <w>', Importance.JOB_MESSAGE_WARNING)
  execution.fake.say('just basic', Importance.JOB_MESSAGE_BASIC)

  detail = json.loads(_get(server.url + 'api/jobs/' + job_id)[2])
  (counter,) = detail['metrics']['counters']
  assert (counter['name'], counter['committed'], counter['attempted']) == (
      'seen<x>', 5, 6)
  (dist,) = detail['metrics']['distributions']
  assert dist['committed'] == {'sum': 12, 'count': 3, 'min': 1, 'max': 7,
                               'mean': 4.0}
  assert detail['metrics']['gauges'][0]['committed'] == 42
  assert detail['options']['spark_parallelism'] == 7
  assert [a['name'] for a in detail['artifacts']] == ['dep<1>.whl']
  assert detail['spark_stages'][0]['url'].endswith('id=3&attempt=0')
  assert detail['streaming']['endpoints'] == {'src': {'grant': 10,
                                                      'backlog': 3}}

  page = _get(server.url + 'jobs/' + job_id)[2].decode()
  for shown in ['seen&lt;x&gt;', 'dep&lt;1&gt;.whl', '&lt;b&gt;bold&lt;/b&gt;',
                'a warning &lt;w&gt;', 'stage&lt;1&gt;', 'backlog',
                'href="http://driver:4040/stages/stage/?id=3&amp;attempt=0"',
                '2/4 tasks', 'id="cancel"']:
    assert shown in page, shown
  assert '<b>bold' not in page and 'seen<x>' not in page
  # Messages filtered by severity, on the page and in its JSON.
  warnings = _get(server.url + 'jobs/' + job_id + '?importance=warning')[2]
  assert b'a warning' in warnings and b'just basic' not in warnings
  assert [m['text'] for m in json.loads(_get(
      server.url + 'api/jobs/' + job_id + '?importance=WARNING')[2])[
          'messages']] == ['a warning <w>']
  live = json.loads(_get(server.url + 'jobs/' + job_id + '/live')[2])
  assert live['state'] == 'RUNNING' and not live['terminal']
  assert '<svg' in live['sections']['job-graph']
  assert 'just basic' in live['sections']['job-messages']


def test_graph_edges_carry_element_counts(live_site):
  from apache_beam.metrics import monitoring_infos as mi
  registry, invoke, wrapped, server = live_site
  job_id = registry.prepare('counted', _pipeline(), {}).job_id
  registry.run(job_id, invoke=invoke)
  plan = plan_pipeline(registry.pipeline(job_id))
  pcolls = [b.split(b':', 1)[1].decode() for s in plan.stages
            for b in s.outputs.values() if b.startswith(b'materialize:')]
  wrapped[job_id].fake.committed_metrics = [
      mi.int64_counter(mi.ELEMENT_COUNT_URN, 1234,
                       pcollection=pcolls[0])]
  wrapped[job_id].progress_value = _progress(
      1, 2, {plan.stages[0].name: 1})
  svg = json.loads(_get(server.url + 'jobs/' + job_id + '/live')[2])[
      'sections']['job-graph']
  assert '1,234 elements' in svg and '1 task(s) done' in svg


def _post(server, path, origin=None, referer=None, host=None, body=b''):
  headers = {}
  if origin:
    headers['Origin'] = origin
  if referer:
    headers['Referer'] = referer
  if host:
    headers['Host'] = host
  request = urllib.request.Request(server.url + path, data=body,
                                   method='POST', headers=headers)
  try:
    with urllib.request.urlopen(request, timeout=10) as response:
      return response.status, response.url
  except urllib.error.HTTPError as error:
    return error.code, None


def test_cancel_is_a_same_origin_post(site):
  registry, executor, server = site
  job_id = registry.prepare('long', _pipeline(), {}).job_id
  registry.run(job_id)
  own = f'http://localhost:{server.port}'
  path = f'jobs/{job_id}/cancel'
  assert _post(server, path)[0] == 403  # neither Origin nor Referer
  assert _post(server, path, origin='http://evil.example')[0] == 403
  assert _post(server, path, referer='http://evil.example/x')[0] == 403
  # A rebound DNS name of this address: Origin and Host agree, still no.
  assert _post(server, path, origin=f'http://evil.example:{server.port}',
               host=f'evil.example:{server.port}')[0] == 403
  assert _post(server, path, origin=own, body=b'x' * 100000)[0] == 413
  assert registry.state(job_id).state == JobState.RUNNING
  assert not executor.executions[job_id].cancelled
  # From the job's own page: redirected back to it, the job cancelled.
  status, url = _post(server, path, origin=own)
  assert status == 200 and url.endswith('/jobs/' + job_id)
  assert executor.executions[job_id].cancelled
  assert registry.state(job_id).state == JobState.CANCELLED
  # The Referer of a page of ours does as well (no Origin sent).
  other = registry.prepare('other', _pipeline(), {}).job_id
  registry.run(other)
  assert _post(server, f'jobs/{other}/cancel',
               referer=f'{own}/jobs/{other}')[0] == 200
  assert registry.state(other).state == JobState.CANCELLED
  # Everything else stays GET only; GET of the cancel route is no route.
  assert _post(server, 'api/jobs', origin=own)[0] == 405
  with pytest.raises(urllib.error.HTTPError) as info:
    _get(server.url + path)
  assert info.value.code == 404


def test_a_streaming_job_drains_from_its_page_and_a_batch_job_is_refused(
    live_site):
  registry, invoke, wrapped, server = live_site
  own = f'http://localhost:{server.port}'
  batch = registry.prepare('batch', _pipeline(), {}).job_id
  registry.run(batch, invoke=invoke)
  assert b'id="drain"' not in _get(server.url + 'jobs/' + batch)[2]
  code = _post(server, f'jobs/{batch}/drain', origin=own)[0]
  assert code == 409 and registry.state(batch).state == JobState.RUNNING
  stream = registry.prepare('stream', _pipeline(), {}).job_id
  registry.run(stream, invoke=invoke)
  wrapped[stream].streaming_value = {'micro_batches': [], 'endpoints': [],
                                     'watermarks': {}}
  page = _get(server.url + 'jobs/' + stream)[2].decode()
  assert f'action="/jobs/{stream}/drain"' in page and 'id="drain"' in page
  assert _post(server, f'jobs/{stream}/drain')[0] == 403  # no Origin
  assert registry.state(stream).state == JobState.RUNNING
  status, url = _post(server, f'jobs/{stream}/drain', origin=own)
  assert status == 200 and url.endswith('/jobs/' + stream)
  assert registry.state(stream).state == JobState.DRAINED


def test_cancel_can_be_turned_off():
  executor = Executor()
  registry = JobRegistry(executor)
  server = StatusServer(StatusPages(registry, cancel_enabled=False)).start()
  try:
    job_id = registry.prepare('kept', _pipeline(), {}).job_id
    registry.run(job_id)
    assert b'id="cancel"' not in _get(server.url + 'jobs/' + job_id)[2]
    assert _post(server, f'jobs/{job_id}/cancel',
                 origin=f'http://localhost:{server.port}')[0] == 403
    assert _post(server, f'jobs/{job_id}/drain',
                 origin=f'http://localhost:{server.port}')[0] == 403
    assert registry.state(job_id).state == JobState.RUNNING
  finally:
    server.stop()


def test_job_ids_with_slashes_have_their_own_pages(site):
  registry, _, server = site
  job_id = registry.prepare('a/b', _pipeline(), {}, job_id='a/b/live').job_id
  page = _get(server.url)[2].decode()
  assert 'href="/jobs/a%2Fb%2Flive"' in page
  detail = json.loads(_get(server.url + 'api/jobs/a%2Fb%2Flive')[2])
  assert detail['job_id'] == job_id


class _Tracker:
  """Spark's StatusTracker as plain data, counting what it is asked."""
  def __init__(self):
    self.jobs, self.stages, self.asked = {}, {}, 0

  def getJobIdsForGroup(self, group):  # pylint: disable=invalid-name
    return list(self.jobs) if group == 'beam-job' else []

  def getJobInfo(self, job_id):  # pylint: disable=invalid-name
    import types
    self.asked += 1
    stage_ids, status = self.jobs[job_id]
    return types.SimpleNamespace(stageIds=stage_ids, status=status)

  def getStageInfo(self, stage_id):  # pylint: disable=invalid-name
    import types
    self.asked += 1
    total, done, active = self.stages[stage_id]
    return types.SimpleNamespace(
        name=f'stage {stage_id}', currentAttemptId=0, numTasks=total,
        numCompletedTasks=done, numActiveTasks=active, numFailedTasks=0)


def test_task_progress_over_a_job_groups_spark_jobs():
  from beam_pyspark.spark import progress
  tracker, ended = _Tracker(), progress._Ended()  # pylint: disable=protected-access
  tracker.jobs = {0: ([0, 1], 'SUCCEEDED'), 1: ([1, 2, 3], 'RUNNING')}
  # Stage 1 ran in job 0 and is reused by job 1; stage 3 waits.
  tracker.stages = {0: (2, 2, 0), 1: (4, 4, 0), 2: (6, 1, 2), 3: (5, 0, 0)}
  got = progress.job_group_progress(tracker, 'beam-job', 'http://ui:4040',
                                    ended)
  assert (got['tasks_done'], got['tasks_total'], got['tasks_active']) == (
      7, 17, 2)
  assert [s['stage_id'] for s in got['stages']] == [0, 1, 2, 3]
  assert got['stages'][2]['url'] == (
      'http://ui:4040/stages/stage/?id=2&attempt=0')
  # Job 1 ends; stage 3 was skipped. Ended jobs are not asked again.
  tracker.jobs[1] = ([1, 2, 3], 'SUCCEEDED')
  tracker.stages[2] = (6, 6, 0)
  progress.job_group_progress(tracker, 'beam-job', None, ended)
  asked = tracker.asked
  got = progress.job_group_progress(tracker, 'beam-job', None, ended)
  assert tracker.asked == asked
  assert (got['tasks_done'], got['tasks_total']) == (12, 12)
  assert [s['stage_id'] for s in got['stages']] == [0, 1, 2]


# -- what a new user found (issue 43) -----------------------------------------


def _page_and_detail(server, job_id):
  quoted = urllib.parse.quote(job_id, safe='')
  return (_get(server.url + 'jobs/' + quoted)[2].decode(),
          json.loads(_get(server.url + 'api/jobs/' + quoted)[2]))


def test_a_jobs_first_state_is_not_stopped_and_its_options_are_the_set_ones(
    live_site):
  import html as html_module
  import re
  from apache_beam.options.pipeline_options import PipelineOptions
  registry, invoke, wrapped, server = live_site
  from apache_beam.runners.job import utils as job_utils
  from apache_beam.runners.portability.portable_runner import JobServiceHandle
  # What Beam's PortableRunner sends: every option, defaults included,
  # encoded as its client encodes them (a value provider's value or null:
  # the options of every PipelineOptions class imported so far, some of
  # them value providers, depending on what ran before in this process).
  sent = job_utils.struct_to_dict(JobServiceHandle.encode_pipeline_options(
      PipelineOptions(['--job_name=nightly-report', '--spark_parallelism=7',
                       '--experiments=use_sdf']).get_all_options(
                           retain_unknown_options=True)))
  sent['beam:option:experiments:v1'] = ['use_sdf', 'beam_fn_api']
  sent['beam:option:spark_master_url:v1'] = 'local[4]'  # Beam's default
  assert len(sent) > 40
  job_id = registry.prepare('nightly-report', _pipeline(), sent).job_id
  registry.run(job_id, invoke=invoke)
  execution = wrapped[job_id]
  execution.progress_value = dict(
      _progress(1, 4), master={'master': 'local[*]', 'cores': 4})
  page, detail = _page_and_detail(server, job_id)
  assert '<h1>nightly-report</h1>' in page
  states = re.findall(r'<h2>States</h2><ul>(.*?)</ul>', page)[0]
  assert 'STOPPED' not in states, states
  assert [s['label'] for s in detail['states']] == [
      'PREPARED', 'STARTING', 'RUNNING']
  assert detail['options_set'] == {
      'experiments': ['use_sdf'], 'job_name': 'nightly-report',
      'spark_parallelism': '7'}  # (Beam's client sends ints as strings)
  shown, hidden = page.split('<details id="all-options">')
  assert 'spark_parallelism' in shown and 'spark_master_url' not in shown
  assert 'local[4]' in hidden  # all of them, a click away
  # The master as asked and as Spark resolved it; Beam's default nowhere
  # outside the collapsed table.
  assert 'Spark master: <span id="spark-master">local[*] (4 cores)' in page
  assert html_module.unescape(page).count('local[4]') == 1


def test_a_failed_jobs_summary_is_its_root_cause(live_site):
  registry, invoke, wrapped, server = live_site
  job_id = registry.prepare('stream', _pipeline(), {}).job_id
  registry.run(job_id, invoke=invoke)
  # The shape of a streaming query's failure that reached the job whole.
  wrapped[job_id].fake.say(
      'Traceback (most recent call last):\n'
      '  File "sources.py", line 418, in _each\n'
      '    self.run_batch(trigger)\n'
      'pyspark.errors.exceptions.captured.StreamingQueryException: '
      '[STREAM_FAILED] Query [id = 1, runId = 2] terminated with exception:'
      ' KafkaException: broker kafka:9092 unreachable SQLSTATE: XXKST\n'
      '=== Streaming Query ===\nCurrent State: ACTIVE\n'
      'Thread State: RUNNABLE\n', Importance.JOB_MESSAGE_ERROR)
  wrapped[job_id].fake.emit(JobState.FAILED)
  page, detail = _page_and_detail(server, job_id)
  assert detail['failure'] == 'KafkaException: broker kafka:9092 unreachable'
  assert ('id="job-failure">KafkaException: broker kafka:9092 unreachable'
          in page)


def test_root_cause_is_the_first_line_or_the_tracebacks_exception():
  from beam_pyspark.errors import root_cause
  assert root_cause("boom 1 [while running 'Parse']\n\nTraceback (most "
                    "recent call last):\n  File \"x.py\", line 1\n"
                    "ValueError: boom 1") == "boom 1 [while running 'Parse']"
  assert root_cause('Traceback (most recent call last):\n  File "a.py", '
                    'line 3, in f\n    g()\n        ^^^\nValueError: bad\n\n'
                    'During handling of the above exception, another '
                    'exception occurred:\n\nTraceback (most recent call '
                    'last):\nRuntimeError: wrapper') == 'ValueError: bad'
  assert root_cause('\nThread State: RUNNABLE\nThe query failed: x') == (
      'The query failed: x')
  assert len(root_cause('x' * 5000)) == 300


def test_a_streaming_jobs_spark_stages_are_bounded_on_its_page(live_site):
  from beam_pyspark.web.pages import STREAMING_STAGES_SHOWN
  registry, invoke, wrapped, server = live_site
  job_id = registry.prepare('stream', _pipeline(), {}).job_id
  registry.run(job_id, invoke=invoke)
  execution = wrapped[job_id]
  execution.streaming_value = {'micro_batches': []}
  stages = [{'stage_id': i, 'attempt': 0, 'name': f'Beam stage {i % 3 + 1}',
             'total': 2, 'done': 2, 'active': 0, 'failed': 0, 'url': None}
            for i in range(100)]
  execution.progress_value = dict(_progress(200, 200), stages=stages,
                                  spark_jobs_count=60)
  page, _ = _page_and_detail(server, job_id)
  table = page.split('<div id="job-stages">')[1].split('</div>')[0]
  assert table.count('<tr>') == STREAMING_STAGES_SHOWN + 1  # and its head
  assert '<td>99</td>' in table and '<td>50</td>' not in table
  assert '60 Spark jobs so far' in table


def test_the_runner_names_an_unnamed_job_after_its_program():
  from beam_pyspark.options import program_job_name
  assert program_job_name('/home/me/wordcount.py') == 'wordcount'
  assert program_job_name('-c') is None
  assert program_job_name('/x/pytest/__main__.py') is None
  assert program_job_name('') is None


def test_an_option_class_defined_after_the_first_page_is_not_shown_as_set():
  """Beam's client sends the options of every PipelineOptions class its
  process imported, defaults included: one defined after the page first
  computed Beam's defaults (a later test module's in CI) read as set."""
  import types
  from apache_beam.options.pipeline_options import PipelineOptions
  from apache_beam.runners.job import utils as job_utils
  from apache_beam.runners.portability.portable_runner import JobServiceHandle
  from beam_pyspark.web import jobdata

  def sent(args):
    return job_utils.struct_to_dict(JobServiceHandle.encode_pipeline_options(
        PipelineOptions(args).get_all_options(retain_unknown_options=True)))

  job = types.SimpleNamespace(options=sent(['--job_name=first']))
  assert jobdata.set_options(job) == {'job_name': 'first'}

  class LateOptions(PipelineOptions):  # pylint: disable=unused-variable
    @classmethod
    def _add_argparse_args(cls, parser):
      parser.add_argument('--late_option_with_a_default', default='dflt')
      parser.add_argument('--late_number', type=int, default=3)
      # (as tests/test_options_and_side_inputs.py's, which CI's workers all
      # collect: its default came as '!' and read as set)
      parser.add_value_provider_argument(
          '--late_provider', type=str, default='!')

  job = types.SimpleNamespace(options=sent(['--job_name=second']))
  assert 'beam:option:late_option_with_a_default:v1' in job.options
  assert job.options['beam:option:late_provider:v1'] == '!'
  assert jobdata.set_options(job) == {'job_name': 'second'}
  job = types.SimpleNamespace(options=sent(
      ['--job_name=third', '--late_number=4', '--late_provider=?']))
  assert jobdata.set_options(job) == {
      'job_name': 'third', 'late_number': '4', 'late_provider': '?'}
