"""The status page's HTTP server: fixed routes over the job registry.

The standard library's ThreadingHTTPServer in a daemon thread (no web
framework next to gRPC's thread pools). It serves no files and takes no
input but the path, a query's message filter and one POST: a bounded
request line and body, job ids looked up in the registry, everything
escaped. Pages read the registry, the same data the Job API serves, and
nothing else.

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
import http.server
import ipaddress
import json
import logging
import socket
import threading
import urllib.parse
from typing import Callable
from typing import Optional

from beam_pyspark.events import JobStateError
from beam_pyspark.planning import plan_pipeline
from beam_pyspark.web import jobdata
from beam_pyspark.web import pages
from beam_pyspark.web import prometheus
from beam_pyspark.web.graph import pipeline_svg

_LOGGER = logging.getLogger(__name__)

# A request line longer than this is refused (414) before any lookup.
MAX_REQUEST_LINE = 2048
# A POST body longer than this is refused (413): cancel takes none.
MAX_POST_BODY = 4096
# Plans of this many jobs are kept: a running job's page asks every 1.5 s.
PLAN_CACHE_SIZE = 16

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
      text = prometheus.exposition(
          self.registry.jobs(), lambda job_id: self.registry.metrics(job_id)[0],
          jobdata.duration)
      return 200, prometheus.CONTENT_TYPE, text.encode('utf-8'), {}
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

  def _rows(self) -> list[dict]:
    return [jobdata.job_row(self.registry, j)
            for j in reversed(self.registry.jobs())]

  def _plan(self, job_id: str):
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


def local_names(host: str) -> set[str]:
  """Host names a request to this server may carry in its Host header
  for a POST: a name of this machine or of the listening address, or an
  IP literal (an ssh tunnel's localhost among them). A DNS-rebound name
  (a page's own domain pointed at this address) is none of them."""
  names = {'localhost', host.lower(), socket.gethostname().lower()}
  try:
    names.add(socket.getfqdn().lower())
  except OSError:
    pass
  return names


def _host_name(host_header: str) -> str:
  host = host_header.strip().lower()
  if host.startswith('['):  # [::1]:8090
    return host[1:host.find(']')]
  return host.rsplit(':', 1)[0] if host.count(':') == 1 else host


def same_origin(headers, allowed_hosts: set[str]) -> bool:
  """Whether a POST comes from a page of this server: its Origin (or,
  without one, its Referer) names the Host it was sent to, and that host
  is one of ours (``local_names``) or an IP literal."""
  host = headers.get('Host')
  if not host:
    return False
  name = _host_name(host)
  try:
    ipaddress.ip_address(name)
  except ValueError:
    if name not in allowed_hosts:
      return False
  origin = headers.get('Origin')
  if origin is not None:
    return origin.lower() == f'http://{host.lower()}'
  referer = urllib.parse.urlsplit(headers.get('Referer') or '')
  return referer.scheme == 'http' and referer.netloc.lower() == host.lower()


class _Handler(http.server.BaseHTTPRequestHandler):
  site: StatusPages  # set on the subclass the server makes
  allowed_hosts: set[str] = set()
  server_version = 'beam-pyspark'

  def handle_one_request(self):  # bounded request line
    self.raw_requestline = self.rfile.readline(MAX_REQUEST_LINE + 1)
    if len(self.raw_requestline) > MAX_REQUEST_LINE:
      self.requestline, self.request_version, self.command = '', '', ''
      self.send_error(414)
      return
    if not self.raw_requestline:
      self.close_connection = True
      return
    if not self.parse_request():
      return
    method = getattr(self, 'do_' + self.command, None)
    if method is None:
      self.send_error(405)
      return
    method()
    self.wfile.flush()

  def _answer(self, route: Callable[[str], Answer]) -> None:
    try:
      status, content_type, body, headers = route(self.path)
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('Status page %s failed', self.path, exc_info=True)
      status, content_type, body, headers = (
          500, 'text/plain', b'internal error', {})
    self._send(status, content_type, body, headers)

  def _send(self, status: int, content_type: str, body: bytes,
            headers: Optional[dict] = None) -> None:
    self.send_response(status)
    self.send_header('Content-Type', content_type)
    self.send_header('Content-Length', str(len(body)))
    self.send_header('Cache-Control', 'no-store')
    # The pages' own inline script and style, nothing from elsewhere;
    # no framing by other sites (a click-jacked Cancel).
    self.send_header(
        'Content-Security-Policy',
        "default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'")
    self.send_header('X-Content-Type-Options', 'nosniff')
    for name, value in (headers or {}).items():
      self.send_header(name, value)
    self.end_headers()
    self.wfile.write(body)

  def do_GET(self):  # pylint: disable=invalid-name
    self._answer(self.site.get)

  def do_POST(self):  # pylint: disable=invalid-name
    """Cancel, and nothing else: a bounded body (read and dropped), from a
    page of this server only."""
    try:
      length = int(self.headers.get('Content-Length') or 0)
    except ValueError:
      length = -1
    if length < 0 or length > MAX_POST_BODY or self.headers.get(
        'Transfer-Encoding'):
      self.close_connection = True
      self._send(413, 'text/plain', b'request body too large\n')
      return
    self.rfile.read(length)
    if not self.site.is_post_route(self.path):
      self.send_error(405)  # every other route is GET only
      return
    if not same_origin(self.headers, self.allowed_hosts):
      self._send(403, 'text/plain',
                 b'cross-origin request refused: post from this server\'s '
                 b'own page\n')
      return
    self._answer(self.site.post)

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    _LOGGER.debug('status page: ' + format, *args)


class StatusServer:
  """Serves ``StatusPages`` on (host, port) from a daemon thread."""
  def __init__(self, pages: StatusPages, host: str = 'localhost',
               port: int = 0):
    handler = type('Handler', (_Handler,), {
        'site': pages, 'allowed_hosts': local_names(host)})
    self._httpd = http.server.ThreadingHTTPServer((host, port), handler)
    self._httpd.daemon_threads = True
    self.host = host
    self.port = self._httpd.server_address[1]
    self._thread = threading.Thread(
        target=self._httpd.serve_forever, name='beam-pyspark-status',
        daemon=True)

  @property
  def url(self) -> str:
    return f'http://{self.host}:{self.port}/'

  def start(self) -> 'StatusServer':
    self._thread.start()
    return self

  def stop(self) -> None:
    self._httpd.shutdown()
    self._httpd.server_close()
