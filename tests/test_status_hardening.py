"""The status page of a real job server under attack and under load
(issue 26): DNS-rebound Host headers, idle half-requests, bursts of
concurrent GETs, secrets in options. Real sockets, a real
``beam-pyspark job-server`` subprocess (tests/jobserver_process.py)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time

import pytest
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.runners.job import utils as job_utils

from jobserver_process import JobServerProcess
from test_registry import _pipeline

SECRET = 'wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY'
FOREIGN = 'rebind.attacker.example'


def _request(port, path, host, method='GET', headers=(), timeout=30):
  """(status, body) of one request over a new connection."""
  lines = [f'{method} {path} HTTP/1.1', f'Host: {host}', *headers]
  if method == 'POST':
    lines.append('Content-Length: 0')
  with socket.create_connection(('127.0.0.1', port), timeout=timeout) as s:
    s.sendall(('\r\n'.join(lines) + '\r\n\r\n').encode())
    data = b''
    while chunk := s.recv(65536):
      data += chunk
  head, _, body = data.partition(b'\r\n\r\n')
  return int(head.split(b' ', 2)[1]), body


def _threads(pid):
  with open(f'/proc/{pid}/status') as f:
    return int(re.search(r'^Threads:\s+(\d+)', f.read(), re.M).group(1))


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  server = JobServerProcess(tmp_path_factory.mktemp('status') / 'server',
                            '--status-allowed-host', 'proxy.example')
  yield server
  server.stop()


@pytest.fixture(scope='module')
def secret_job(server):
  options = {
      'beam:option:s3_secret_access_key:v1': SECRET,
      'beam:option:spark_conf:v1': [f'spark.hadoop.fs.s3a.secret.key={SECRET}'],
      'beam:option:key_coder:v1': 'kept-visible',
      'beam:option:job_name:v1': 'secretive',
  }
  prepared = server.job_stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
      pipeline=_pipeline(), job_name='secretive',
      pipeline_options=job_utils.dict_to_struct(options)))
  return prepared.preparation_id


def test_a_foreign_host_is_refused_on_every_route(server, secret_job):
  port = int(server.status_url.rsplit(':', 1)[1].strip('/'))
  job = secret_job
  gets = ['/', '/api/jobs', f'/api/jobs/{job}', f'/jobs/{job}',
          f'/jobs/{job}/live', '/metrics', '/healthz', '/readyz', '/nope']
  for path in gets:
    status, body = _request(port, path, f'{FOREIGN}:{port}')
    assert status == 403, (path, status)
    assert job.encode() not in body and b'secretive' not in body
    assert b'--status-allowed-host' in body
  for action in ('cancel', 'drain'):
    own_origin = f'Origin: http://{FOREIGN}:{port}'
    status, _ = _request(port, f'/jobs/{job}/{action}', f'{FOREIGN}:{port}',
                         method='POST', headers=[own_origin])
    assert status == 403
  state = server.job_stub.GetState(
      beam_job_api_pb2.GetJobStateRequest(job_id=job)).state
  assert state == beam_job_api_pb2.JobState.STOPPED  # not cancelled
  # Its own names, IP literals and the operator's name all work.
  for host in (f'localhost:{port}', f'127.0.0.1:{port}', f'[::1]:{port}',
               'proxy.example', f'{socket.gethostname()}:{port}'):
    status, body = _request(port, f'/api/jobs/{job}', host)
    assert status == 200, host
    assert json.loads(body)['job_id'] == job
  # A request without Host: refused in HTTP/1.1, which requires one.
  with socket.create_connection(('127.0.0.1', port), timeout=10) as s:
    s.sendall(b'GET /api/jobs HTTP/1.1\r\n\r\n')
    assert s.recv(100).startswith(b'HTTP/1.1 403 ')


def test_secret_option_values_are_redacted_everywhere(server, secret_job):
  port = int(server.status_url.rsplit(':', 1)[1].strip('/'))
  host = f'localhost:{port}'
  for path in (f'/api/jobs/{secret_job}', f'/jobs/{secret_job}',
               f'/jobs/{secret_job}/live', '/api/jobs', '/metrics'):
    status, body = _request(port, path, host)
    assert status == 200
    assert SECRET.encode() not in body, path
  detail = json.loads(_request(port, f'/api/jobs/{secret_job}', host)[1])
  options = detail['options']
  assert options['s3_secret_access_key'] == '********'
  assert options['spark_conf'] == ['spark.hadoop.fs.s3a.secret.key=********']
  assert options['key_coder'] == 'kept-visible'  # not a secret's name
  jobs = server.job_stub.GetJobs(beam_job_api_pb2.GetJobsRequest())
  (info,) = [j for j in jobs.job_info if j.job_id == secret_job]
  assert SECRET not in str(info.pipeline_options)
  assert job_utils.struct_to_dict(info.pipeline_options)[
      'beam:option:s3_secret_access_key:v1'] == '********'
  # The job's messages (the ignored --spark_conf is noted) and the
  # server's log hold no secret either.
  assert SECRET not in _request(port, f'/jobs/{secret_job}', host)[1].decode()
  assert 'spark_conf' in ''.join(m['text'] for m in detail['messages'])
  assert SECRET not in server.log()


def test_idle_half_requests_hold_no_thread_and_are_closed(server):
  port = int(server.status_url.rsplit(':', 1)[1].strip('/'))
  before = _threads(server.pid)
  idle = []
  for _ in range(30):
    s = socket.create_connection(('127.0.0.1', port), timeout=90)
    s.sendall(b'GET /hea')
    idle.append(s)
  try:
    time.sleep(1)
    assert _threads(server.pid) <= before + 2
    # The page still answers meanwhile.
    assert _request(port, '/healthz', f'localhost:{port}', timeout=10)[0] == 200
    started = time.monotonic()
    for s in idle:
      data = b''
      while chunk := s.recv(1000):
        data += chunk
      assert data.startswith(b'HTTP/1.1 408 ')
    # The header timeout is 15 s; closed well within a minute.
    assert time.monotonic() - started < 60
  finally:
    for s in idle:
      s.close()


@pytest.mark.parametrize('path', ['/healthz', '/metrics'])
def test_a_burst_of_200_gets_all_answered_within_10_s(server, secret_job,
                                                      path):
  port = int(server.status_url.rsplit(':', 1)[1].strip('/'))
  n = 200
  barrier = threading.Barrier(n)

  def one(_):
    barrier.wait(30)
    started = time.monotonic()
    status, body = _request(port, path, f'localhost:{port}', timeout=30)
    return status, len(body), time.monotonic() - started

  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    results = list(pool.map(one, range(n)))
  statuses = [r[0] for r in results]
  times = sorted(r[2] for r in results)
  print(f'{n} GETs of {path}: median {times[n // 2]:.3f} s, slowest '
        f'{times[-1]:.3f} s, {results[0][1]} bytes each')
  assert statuses == [200] * n
  assert times[-1] < 10, f'median {times[n // 2]:.2f} s, slowest {times[-1]:.2f} s'
  assert all(r[1] > 0 for r in results)
