"""A checkpoint store that stops answering (issue 40, item 5).

moto's S3 server frozen with SIGSTOP (beam_pyspark/local/stores.py), and a
WebHDFS "namenode" that accepts connections and never answers: a store
call fails within ``--checkpoint_store_timeout_secs`` (a request, tried
once more on S3) naming the store and what it was for, and is reported
while it waits. Then a streaming job (a real job server, Beam's
PortableRunner) with its checkpoint on the frozen S3 server: its
messages name the store within a bounded time (it used to say nothing
while S3 was frozen for 6 minutes, and FAILED 4 s after it came back).
The server is always resumed (SIGCONT) in a ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from beam_pyspark.local.stores import MotoS3
from beam_pyspark.storage import Location
from beam_pyspark.storage import StoreTimeoutError
from beam_pyspark.storage import doing
from beam_pyspark.storage import storage_options
from checkpoint_store_checks import job_options
from jobserver_process import JobServerProcess
from test_jobserver_resume import EMBEDDED
from test_jobserver_resume import TESTS
import streaming_recovery_job as job

TIMEOUT = 2  # --checkpoint_store_timeout_secs in these tests


@pytest.fixture(scope='module')
def s3(tmp_path_factory):
  server = MotoS3(str(tmp_path_factory.mktemp('s3')))
  yield server
  server.stop()


@contextlib.contextmanager
def frozen(server):
  """``server``'s process stopped (SIGSTOP) inside; always resumed."""
  os.killpg(server.process.pid, signal.SIGSTOP)
  try:
    yield
  finally:
    os.killpg(server.process.pid, signal.SIGCONT)


def _location(s3, path, timeout=TIMEOUT):
  return Location.parse(s3.url(path), storage_options(job_options(
      [*s3.options, f'--checkpoint_store_timeout_secs={timeout}'])))


def test_a_frozen_s3_store_fails_the_call_naming_it_and_says_so_meanwhile(s3):
  store = _location(s3, f'frozen-{uuid.uuid4().hex[:8]}').store()
  store.write('manifests/.keep', b'')  # the connection is made, and pooled
  said = []
  started = time.monotonic()
  with frozen(s3), pytest.raises(StoreTimeoutError) as info:
    with doing('committing the manifest of micro-batch 7', said.append):
      store.commit('manifests/7', b'manifest')
  took = time.monotonic() - started
  text = str(info.value)
  assert s3.url('frozen-') in text and s3.endpoint in text, text
  assert 'micro-batch 7' in text and 'within 2 s' in text, text
  # Two requests of 2 s each, and botocore's backoff between them.
  assert took < 20, took
  assert said and all(s3.endpoint in s and 'micro-batch 7' in s
                      for s in said), said
  # The store answers again once the server does.
  assert store.read('manifests/.keep') == b''


def test_a_webhdfs_namenode_that_never_answers_fails_the_call_naming_it():
  listener = socket.socket()
  listener.bind(('127.0.0.1', 0))
  listener.listen(8)  # accepted by the kernel, never answered
  port = listener.getsockname()[1]
  try:
    store = Location.parse(
        f'webhdfs://127.0.0.1:{port}/ckpt',
        {'checkpoint_store_timeout_secs': TIMEOUT}).store()
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
      store.listdir('manifests')
    assert time.monotonic() - started < 15
    text = str(info.value)
    assert f'webhdfs://127.0.0.1:{port}/ckpt' in text, text
    assert 'listing' in text and 'ReadTimeout' in text, text
  finally:
    listener.close()


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  process = JobServerProcess(tmp_path_factory.mktemp('deadlines') / 'server',
                             env={'PYTHONPATH': TESTS})
  yield process
  process.stop()


def _messages(server, job_id, found, done):
  """Appends the job's message texts and states to ``found`` until
  ``done`` is set or the stream ends."""
  stream = server.job_stub.GetMessageStream(
      beam_job_api_pb2.JobMessagesRequest(job_id=job_id))
  done.stream = stream
  for response in stream:
    if response.HasField('message_response'):
      found.append(response.message_response.message_text)
    else:
      found.append(response.state_response.state)


def test_a_streaming_job_on_a_frozen_s3_store_names_it_in_bounded_time(
    s3, server, tmp_path):
  path = f'job-{uuid.uuid4().hex[:8]}'
  url, store = s3.url(path), _location(s3, path).store()
  out = tmp_path / 'out'
  out.mkdir()
  p = beam.Pipeline(options=PipelineOptions([
      '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
      f'--environment_type={EMBEDDED}', '--streaming',
      f'--max_records_per_batch={job.SDF_BUDGET}',
      f'--checkpoint_location={url}', *s3.options,
      f'--checkpoint_store_timeout_secs={TIMEOUT}']))
  job.build_sums(p, str(out))
  result = p.run()
  job_id = result._job_id  # pylint: disable=protected-access
  found: list = []
  done = threading.Event()
  reader = threading.Thread(
      target=_messages, args=(server, job_id, found, done), daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 240
    while not [n for n in store.listdir('manifests') if n.isdigit()]:
      assert server.proc.poll() is None, server.log()
      assert time.monotonic() < deadline, f'nothing committed:\n{found}'
      time.sleep(0.2)
    with frozen(s3):
      frozen_at = time.monotonic()
      named = None
      # The first request to wait is the driver's (a warning after
      # TIMEOUT s) or the query source's (a failure after 2 * TIMEOUT s,
      # the job FAILED): either names the store. Bounded generously:
      # Spark's failure takes a few seconds more to reach the job.
      while named is None and time.monotonic() - frozen_at < 90:
        named = next((t for t in list(found) if isinstance(t, str) and
                      url in t and ('has not answered' in t or
                                    'did not answer' in t)), None)
        time.sleep(0.2)
      took = time.monotonic() - frozen_at
    assert named is not None, '\n'.join(map(str, found))[-4000:]
    assert s3.endpoint in named, named
  finally:
    try:  # a job that FAILED already cannot be cancelled
      server.job_stub.Cancel(
          beam_job_api_pb2.CancelJobRequest(job_id=job_id))
    except Exception:  # pylint: disable=broad-except
      pass
    reader.join(120)
    getattr(done, 'stream', None) and done.stream.cancel()
  assert took < 90
  states = [s for s in found if not isinstance(s, str)]
  assert states[-1] in (beam_job_api_pb2.JobState.FAILED,
                        beam_job_api_pb2.JobState.CANCELLED), states
  print(f'named the store {took:.1f} s after the freeze: {named[:300]}')
