"""The status page's HTTP server: fixed routes over the job registry.

The standard library's ThreadingHTTPServer in a daemon thread (no web
framework next to gRPC's thread pools). It serves no files and takes no
input but the path: GET only, a bounded request line, job ids looked up in
the registry, everything escaped. Pages read the registry, the same data
the Job API serves, and nothing else.

    /                 the jobs: name, id, state, submitted, duration
    /api/jobs         the same as JSON
    /jobs/<id>        one job: its state history, its fused stages as a
                      graph, its messages
    /metrics          jobs and their Beam metrics for Prometheus
                      (web.prometheus)
    /healthz          200 while the server answers
    /readyz           200 while it takes jobs, 503 once it is stopping
"""

from __future__ import annotations

import html
import http.server
import json
import logging
import threading
import time
import urllib.parse
from typing import Optional

from beam_pyspark.events import JobState
from beam_pyspark.events import state_name
from beam_pyspark.web import prometheus

_LOGGER = logging.getLogger(__name__)

# A request line longer than this is refused (414) before any lookup.
MAX_REQUEST_LINE = 2048
# Messages shown on a job's page: its last ones.
MAX_MESSAGES_SHOWN = 500

_STYLE = '''
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; }
td, th { padding: .25em .75em; border-bottom: 1px solid #ddd; text-align: left; }
.state-DONE { color: #176f2c; } .state-FAILED { color: #b00020; }
.state-RUNNING { color: #0b57d0; } .state-CANCELLED { color: #6d4c00; }
pre { white-space: pre-wrap; }
'''


def _page(title: str, body: str) -> bytes:
  return (f'<!doctype html><html><head><meta charset="utf-8">'
          f'<title>{html.escape(title)}</title><style>{_STYLE}</style>'
          f'</head><body>{body}</body></html>').encode('utf-8')


def _when(ts: float) -> str:
  return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))


def _duration(job) -> Optional[float]:
  started = next((e.timestamp for e in job.states
                  if e.state == JobState.RUNNING), None)
  if started is None:
    return None
  ended = job.states[-1].timestamp if job.states[-1].terminal else time.time()
  return max(0.0, ended - started)


def _job_row(job) -> dict:
  duration = _duration(job)
  return {
      'job_id': job.job_id,
      'job_name': job.job_name,
      'state': state_name(job.state),
      'submitted': job.created,
      'duration_secs': None if duration is None else round(duration, 3),
  }


class StatusPages:
  """What each route answers; (status, content type, body)."""
  def __init__(self, registry, plan_svg=None):
    self.registry = registry
    # plan_svg(pipeline proto) -> SVG text, or None: the stage graph.
    self.plan_svg = plan_svg

  def get(self, path: str) -> tuple[int, str, bytes]:
    path = urllib.parse.urlsplit(path).path
    if path == '/':
      return 200, 'text/html; charset=utf-8', self._jobs_page()
    if path == '/metrics':
      text = prometheus.exposition(
          self.registry.jobs(), lambda job_id: self.registry.metrics(job_id)[0],
          _duration)
      return 200, prometheus.CONTENT_TYPE, text.encode('utf-8')
    if path == '/healthz':
      return 200, 'text/plain', b'ok\n'
    if path == '/readyz':
      if self.registry.closing:
        return 503, 'text/plain', b'stopping: no new jobs\n'
      return 200, 'text/plain', b'ready\n'
    if path == '/api/jobs':
      rows = [_job_row(j) for j in reversed(self.registry.jobs())]
      return 200, 'application/json', json.dumps(rows).encode('utf-8')
    if path.startswith('/jobs/'):
      job_id = urllib.parse.unquote(path[len('/jobs/'):])
      try:
        job = self.registry.job(job_id)
      except KeyError:
        return 404, 'text/html; charset=utf-8', _page(
            'No such job', f'<p>No job with id <code>{html.escape(job_id)}'
            '</code>. <a href="/">All jobs</a></p>')
      return 200, 'text/html; charset=utf-8', self._job_page(job)
    return 404, 'text/html; charset=utf-8', _page(
        'Not found', '<p>Not found. <a href="/">All jobs</a></p>')

  def _jobs_page(self) -> bytes:
    rows = []
    for job in reversed(self.registry.jobs()):
      row = _job_row(job)
      duration = ('' if row['duration_secs'] is None else
                  f'{row["duration_secs"]:.1f} s')
      rows.append(
          f'<tr><td><a href="/jobs/{urllib.parse.quote(job.job_id)}">'
          f'{html.escape(job.job_name)}</a></td>'
          f'<td><code>{html.escape(job.job_id)}</code></td>'
          f'<td class="state-{row["state"]}">{row["state"]}</td>'
          f'<td>{_when(job.created)}</td><td>{duration}</td></tr>')
    table = ('<table><tr><th>Name</th><th>Id</th><th>State</th>'
             '<th>Submitted</th><th>Duration</th></tr>' + ''.join(rows) +
             '</table>') if rows else '<p>No jobs yet.</p>'
    return _page('beam-pyspark jobs', f'<h1>Jobs</h1>{table}')

  def _job_page(self, job) -> bytes:
    states = ''.join(
        f'<li>{_when(e.timestamp)} {state_name(e.state)}</li>'
        for e in job.states)
    graph = ''
    if self.plan_svg is not None:
      try:
        graph = self.plan_svg(self.registry.pipeline(job.job_id)) or ''
      except Exception:  # pylint: disable=broad-except
        _LOGGER.debug('No stage graph for %s', job.job_id, exc_info=True)
        graph = '<p>The stage graph could not be drawn.</p>'
    messages = self.registry.messages(job.job_id)[-MAX_MESSAGES_SHOWN:]
    lines = ''.join(
        f'<li>{_when(m.timestamp)} <pre>{html.escape(m.text)}</pre></li>'
        for m in messages)
    return _page(
        f'{job.job_name} - beam-pyspark',
        f'<p><a href="/">All jobs</a></p><h1>{html.escape(job.job_name)}</h1>'
        f'<p><code>{html.escape(job.job_id)}</code> '
        f'<span class="state-{state_name(job.state)}">'
        f'{state_name(job.state)}</span></p>'
        f'<h2>States</h2><ul>{states}</ul>'
        f'<h2>Stages</h2>{graph}'
        f'<h2>Messages</h2><ul>{lines}</ul>')


class _Handler(http.server.BaseHTTPRequestHandler):
  pages: StatusPages  # set on the subclass the server makes
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

  def do_GET(self):  # pylint: disable=invalid-name
    try:
      status, content_type, body = self.pages.get(self.path)
    except Exception:  # pylint: disable=broad-except
      _LOGGER.warning('Status page %s failed', self.path, exc_info=True)
      status, content_type, body = 500, 'text/plain', b'internal error'
    self.send_response(status)
    self.send_header('Content-Type', content_type)
    self.send_header('Content-Length', str(len(body)))
    self.send_header('Cache-Control', 'no-store')
    self.end_headers()
    self.wfile.write(body)

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    _LOGGER.debug('status page: ' + format, *args)


class StatusServer:
  """Serves ``StatusPages`` on (host, port) from a daemon thread."""
  def __init__(self, pages: StatusPages, host: str = 'localhost',
               port: int = 0):
    handler = type('Handler', (_Handler,), {'pages': pages})
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
