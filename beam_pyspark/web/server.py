"""The status page: fixed routes over the job registry.

Served by web.httpserver (asyncio in a daemon thread, a bounded pool of
workers; no web framework next to gRPC's thread pools). It serves no files
and takes no input but the path, a query's message filter and two POSTs:
a bounded request line and body, job ids looked up in the registry,
everything escaped, and only requests that name one of its own hosts
(web.hosts: DNS rebinding). Pages read the registry, the same data the Job
API serves, and nothing else; secret-looking option values are redacted
(beam_pyspark.redaction).

    GET  /                   the jobs: name, id, state, progress (Spark
                             tasks), submitted, duration; live
    GET  /api/jobs           the same as JSON
    GET  /jobs/<id>          one job: state and progress, its fused stages
                             as a graph with element counts, Spark stages,
                             user metrics, messages (?importance=WARNING
                             and above...), states, options, artifacts
    GET  /api/jobs/<id>      the same as JSON
    GET  /jobs/<id>/live     the page's changing sections, for its script
    POST /jobs/<id>/cancel   cancels the job (same origin only; off with
                             cancel_enabled=False)
    POST /jobs/<id>/drain    drains a running streaming job (the same)
    GET  /metrics            jobs and their Beam metrics for Prometheus
                             (web.prometheus)
    GET  /healthz            200 while the server answers
    GET  /readyz             200 while it takes jobs, 503 once it is stopping
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import urllib.parse
from typing import Callable
from typing import Iterable
from typing import Optional

from beam_pyspark.events import JobStateError
from beam_pyspark.planning import plan_pipeline
from beam_pyspark.web import jobdata
from beam_pyspark.web import pages
from beam_pyspark.web import prometheus
from beam_pyspark.web.graph import pipeline_svg
from beam_pyspark.web.hosts import HostPolicy
from beam_pyspark.web.hosts import same_origin
from beam_pyspark.web.httpserver import HttpServer
from beam_pyspark.web.httpserver import Request
from beam_pyspark.web.httpserver import Response

_LOGGER = logging.getLogger(__name__)

# A POST body longer than this is refused (413): cancel takes none.
MAX_POST_BODY = 4096
# Plans of this many jobs are kept: a running job's page asks every 1.5 s.
PLAN_CACHE_SIZE = 16
# /metrics is computed at most this often; scrapes in between (a burst of
# them, several Prometheus replicas) get the last text. Prometheus scrapes
# every 15 s or more.
METRICS_MAX_AGE_SECS = 1.0

HTML = 'text/html; charset=utf-8'
JSON = 'application/json'
Answer = tuple[int, str, bytes, dict]


def _json(value) -> Answer:
  return 200, JSON, json.dumps(value, default=str).encode('utf-8'), {}


def _not_found(what: str) -> Answer:
  return 404, HTML, pages.page(
      'Not found', f'<p>{pages.html.escape(what)} <a href="/">All jobs</a>'
      '</p>'), {}


class StatusPages:
  """What each route answers: (status, content type, body, headers).

  ``planner(pipeline proto) -> ExecutionPlan`` draws the stage graph
  (None: no graph); ``cancel_enabled``: whether the page may cancel jobs
  (as Flink's web.cancel.enable)."""
  def __init__(self, registry,
               planner: Optional[Callable] = plan_pipeline,
               cancel_enabled: bool = True):
    self.registry = registry
    self.planner = planner
    self.cancel_enabled = cancel_enabled
    self._plans: collections.OrderedDict = collections.OrderedDict()
    self._plans_lock = threading.Lock()
    # One computation of /metrics at a time; the others wait for it.
    self._metrics_lock = threading.Lock()
    self._metrics: tuple[float, bytes] = (float('-inf'), b'')

  # -- GET -----------------------------------------------------------------

  def get(self, path: str) -> Answer:
    parts = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(parts.query)
    importance = (query.get('importance') or [''])[0].upper()
    if importance not in jobdata.SEVERITIES:
      importance = ''
    segments = parts.path.split('/')[1:]
    route = parts.path
    if route == '/':
      return 200, HTML, pages.jobs_page(self._rows()), {}
    if route == '/api/jobs':
      return _json(self._rows())
    if route == '/metrics':
      return 200, prometheus.CONTENT_TYPE, self._exposition(), {}
    if route == '/healthz':
      return 200, 'text/plain', b'ok\n', {}
    if route == '/readyz':
      if self.registry.closing:
        return 503, 'text/plain', b'stopping: no new jobs\n', {}
      return 200, 'text/plain', b'ready\n', {}
    api = segments[:1] == ['api']
    if api:
      segments = segments[1:]
    if len(segments) not in (2, 3) or segments[0] != 'jobs' or (
        len(segments) == 3 and (api or segments[2] != 'live')):
      return _not_found('Not found.')
    job_id = urllib.parse.unquote(segments[1])
    min_importance = jobdata.importance_of(importance)
    try:
      detail = jobdata.job_detail(self.registry, job_id, min_importance)
    except KeyError:
      return _not_found(f'No job with id {job_id!r}.')
    if api:
      return _json(detail)
    sections = pages.job_sections(detail, lambda: self._graph(detail))
    if len(segments) == 3:  # live
      return _json({'state': detail['state'], 'terminal': detail['terminal'],
                    'sections': sections})
    return 200, HTML, pages.job_page(
        detail, sections, importance, self.cancel_enabled), {}

  def _exposition(self) -> bytes:
    with self._metrics_lock:
      at, text = self._metrics
      if time.monotonic() - at > METRICS_MAX_AGE_SECS:
        text = prometheus.exposition(
            self.registry.jobs(),
            lambda job_id: self.registry.metrics(job_id)[0],
            jobdata.duration).encode('utf-8')
        self._metrics = (time.monotonic(), text)
      return text

  def _rows(self) -> list[dict]:
    return [jobdata.job_row(self.registry, j)
            for j in reversed(self.registry.jobs())]

  def _plan(self, job_id: str):
    # The plan the job runs, once it is planned: a streaming job's has
    # more stages than a batch plan of its pipeline, and Spark's stages
    # are named by its numbering ("Beam stage 6"), so the graph must be.
    running = self.registry.plan(job_id)
    if running is not None:
      return running
    with self._plans_lock:
      if job_id in self._plans:
        self._plans.move_to_end(job_id)
        return self._plans[job_id]
    plan = self.planner(self.registry.pipeline(job_id))
    with self._plans_lock:
      self._plans[job_id] = plan
      while len(self._plans) > PLAN_CACHE_SIZE:
        self._plans.popitem(last=False)
    return plan

  def _graph(self, detail: dict) -> str:
    if self.planner is None:
      return ''
    try:
      plan = self._plan(detail['job_id'])
    except Exception:  # pylint: disable=broad-except
      _LOGGER.debug('No stage graph for %s', detail['job_id'], exc_info=True)
      return '<p>The stage graph could not be drawn.</p>'
    done = detail['beam_stage_tasks_done']
    statuses = {name: f'{n:,} task(s) done' for name, n in done.items()}
    return pipeline_svg(plan, detail['element_counts'], statuses)

  # -- POST ----------------------------------------------------------------

  @staticmethod
  def is_post_route(path: str) -> bool:
    segments = urllib.parse.urlsplit(path).path.split('/')[1:]
    return (len(segments) == 3 and segments[0] == 'jobs' and
            segments[2] in ('cancel', 'drain'))

  def post(self, path: str) -> Answer:
    """Only /jobs/<id>/cancel and /jobs/<id>/drain; the caller checked
    the origin."""
    if not self.is_post_route(path):
      return _not_found('Not found.')
    segments = urllib.parse.urlsplit(path).path.split('/')[1:]
    action = segments[2]
    if not self.cancel_enabled:
      return 403, 'text/plain', (
          b'Cancelling or draining from the status page is turned off on '
          b'this server (--no-status-cancel).\n'), {}
    job_id = urllib.parse.unquote(segments[1])
    try:
      if action == 'drain':
        self.registry.drain(job_id)
      else:
        self.registry.cancel(job_id)
    except KeyError:
      return _not_found(f'No job with id {job_id!r}.')
    except JobStateError as e:
      return 409, 'text/plain', f'{e}\n'.encode('utf-8'), {}
    _LOGGER.info('Job %s: %s asked from the status page', job_id, action)
    return 303, 'text/plain', f'{action} asked\n'.encode('utf-8'), {
        'Location': pages.job_path(job_id)}


# The pages' own inline script and style, nothing from elsewhere; no
# framing by other sites (a click-jacked Cancel).
_SECURITY_HEADERS = {
    'Cache-Control': 'no-store',
    'Content-Security-Policy':
        "default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'",
    'X-Content-Type-Options': 'nosniff',
}


def _text(status: int, text: str) -> Answer:
  return status, 'text/plain; charset=utf-8', f'{text}\n'.encode('utf-8'), {}


class StatusServer:
  """Serves ``StatusPages`` on (host, port); ``allowed_hosts``: names
  besides its own that requests may carry in Host (web.hosts)."""
  def __init__(self, pages: StatusPages, host: str = 'localhost',
               port: int = 0, allowed_hosts: Iterable[str] = ()):
    self.site = pages
    self.policy = HostPolicy(host, allowed_hosts)
    self._http = HttpServer(self._answer, host, port, max_body=MAX_POST_BODY,
                            name='beam-pyspark-status')
    self.host = host
    self.port = self._http.port

  @property
  def url(self) -> str:
    return f'http://{self.host}:{self.port}/'

  def start(self) -> 'StatusServer':
    self._http.start()
    return self

  def stop(self) -> None:
    self._http.stop()

  def _answer(self, request: Request) -> Response:
    status, content_type, body, headers = self._route(request)
    return Response(status, content_type, body,
                    {**_SECURITY_HEADERS, **headers})

  def _route(self, request: Request) -> Answer:
    host = request.headers.get('Host')
    if not self.policy.allows(host, request.version):
      return _text(403, (
          f'This status page does not answer to the host '
          f'{(host or "")[:100]!r}: only to its own names and IP addresses. '
          'If this is a name of its own, start the job server with '
          '--status-allowed-host NAME.') if host else (
          'A request without a Host header is refused.'))
    if request.method == 'GET':
      return self._call(self.site.get, request.path)
    if request.method != 'POST' or not self.site.is_post_route(request.path):
      return _text(405, 'Method not allowed: every route but a job\'s '
                   'cancel and drain is GET only.')
    if not same_origin(request.headers, self.policy):
      return _text(403, 'cross-origin request refused: post from this '
                   'server\'s own page')
    return self._call(self.site.post, request.path)

  @staticmethod
  def _call(route: Callable[[str], Answer], path: str) -> Answer:
    try:
      return route(path)
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('Status page %s failed', path[:200], exc_info=True)
      return _text(500, 'internal error')
