"""Large staged dependencies never pass whole through the driver's memory
(issue 26), and running out of memory says so.

A real ``beam-pyspark job-server`` subprocess on local[2]; Beam's own
client code stages (``offer_artifacts``, as its PortableRunner does).
A 1 GiB dependency is staged and run: the job's DoFn finds the whole file
on its executor, while the job server's resident memory stays far below
the file's size (it grew by the file's size, and the driver's JVM died,
when the driver read it into a broadcast). Past ``--max-artifact-bytes``
a dependency is refused at staging, naming the limit and the flag. A DoFn
that runs out of memory fails its job with "Out of memory" first.
"""

from __future__ import annotations

import hashlib
import os
import threading

import apache_beam as beam
import grpc
import psutil
import pytest
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.runners.portability import artifact_service as beam_artifacts
from apache_beam.transforms import environments

from jobserver_process import JobServerProcess
from jobserver_process import file_dependency

MB = 1 << 20
GIB = 1 << 30
# The job server started at about 280 MiB in the measurement;
# reading the file whole took it past 1300.
MAX_DRIVER_RSS = 400 * MB


def _sparse_file(path, size) -> str:
  """A file of ``size`` zero bytes that takes no disk (every byte still
  travels); its sha256."""
  with open(path, 'wb') as f:
    f.truncate(size)
  hasher, block = hashlib.sha256(), bytes(8 * MB)
  for _ in range(size // len(block)):
    hasher.update(block)
  return hasher.hexdigest()


def _pipeline(out_path, artifacts):
  """Writes the size and digest of the staged file 'big.bin' as the
  executor sees it (the staged directory is on its sys.path)."""
  def describe(_):
    import hashlib as h
    import sys
    for directory in sys.path:
      path = os.path.join(directory, 'big.bin')
      if os.path.isfile(path):
        digest = h.sha256()
        with open(path, 'rb') as f:
          while chunk := f.read(8 << 20):
            digest.update(chunk)
        with open(out_path, 'w', encoding='utf-8') as out:
          out.write(f'{os.path.getsize(path)} {digest.hexdigest()}')
        return
    raise FileNotFoundError(f'big.bin on none of {sys.path}')

  p = beam.Pipeline()
  _ = p | beam.Create([0]) | beam.Map(describe)
  return p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment(
          capabilities=environments.python_sdk_capabilities(),
          artifacts=list(artifacts)))


def _stage(server, pipeline, name):
  prepared = server.job_stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
      job_name=name, pipeline=pipeline))
  beam_artifacts.offer_artifacts(
      server.staging_stub,
      beam_artifacts.ArtifactRetrievalService(
          beam_artifacts.BeamFilesystemHandler(None).file_reader),
      prepared.staging_session_token)
  return prepared.preparation_id


def _run_to_end(server, job_id):
  server.job_stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  for event in server.job_stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id=job_id), timeout=600):
    if event.state in (beam_job_api_pb2.JobState.DONE,
                       beam_job_api_pb2.JobState.FAILED,
                       beam_job_api_pb2.JobState.CANCELLED):
      return event.state
  raise AssertionError('the state stream ended before the job')


def _errors(server, job_id):
  """The job's ERROR messages (its stream ends with the job)."""
  error = beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_ERROR
  return [r.message_response.message_text
          for r in server.job_stub.GetMessageStream(
              beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=60)
          if r.HasField('message_response') and
          r.message_response.importance == error]


class _PeakRss:
  """The peak resident memory of a process and its Java children (the
  driver's JVM), sampled on a thread."""
  def __init__(self, pid):
    self.process = psutil.Process(pid)
    self.python = self.jvm = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      try:
        self.python = max(self.python, self.process.memory_info().rss)
        for child in self.process.children():
          if 'java' in child.name():
            self.jvm = max(self.jvm, child.memory_info().rss)
      except psutil.Error:
        pass
      self._stop.wait(0.05)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  root = tmp_path_factory.mktemp('large')
  server = JobServerProcess(
      root / 'server', env={'BEAM_PYSPARK_DEPS_DIR': str(root / 'deps')})
  yield server
  server.stop()


def test_a_1_gib_dependency_runs_without_passing_through_the_driver(
    server, tmp_path):
  source = tmp_path / 'client' / 'big.bin'
  source.parent.mkdir()
  digest = _sparse_file(source, GIB)
  out = tmp_path / 'seen'
  job_id = _stage(server, _pipeline(
      str(out), [file_dependency(str(source), 'big.bin')]), 'big')
  with _PeakRss(server.pid) as peak:
    state = _run_to_end(server, job_id)
  print(f'job server peak RSS {peak.python / MB:.0f} MiB, driver JVM '
        f'peak RSS {peak.jvm / MB:.0f} MiB')
  assert state == beam_job_api_pb2.JobState.DONE, server.log()
  assert out.read_text() == f'{GIB} {digest}'
  assert peak.python < MAX_DRIVER_RSS, f'{peak.python / MB:.0f} MiB'
  assert peak.jvm > 0  # it was watched, and never held the file
  assert peak.jvm < GIB


def test_a_dependency_over_the_limit_is_refused_at_staging(tmp_path):
  source = tmp_path / 'client' / 'big.bin'
  source.parent.mkdir()
  _sparse_file(source, 3 * MB)
  server = JobServerProcess(tmp_path / 'server',
                            '--max-artifact-bytes', str(2 * MB))
  try:
    with pytest.raises(grpc.RpcError) as info:
      _stage(server, _pipeline(
          str(tmp_path / 'seen'), [file_dependency(str(source), 'big.bin')]),
          'too-big')
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details()
    assert '--max-artifact-bytes' in details and str(2 * MB) in details
    assert 'big.bin' in details
    # Nothing of it is kept.
    staged = tmp_path / 'server' / 'staged'
    assert [n for n in os.listdir(staged)] == []
  finally:
    server.stop()


def test_running_out_of_memory_says_so_first(server):
  def allocate(_):
    return bytearray(1 << 62)  # a real MemoryError, in the executor
  p = beam.Pipeline()
  _ = p | beam.Create([0]) | beam.Map(allocate)
  pipeline = p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default())
  prepared = server.job_stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
      job_name='oom', pipeline=pipeline))
  state = _run_to_end(server, prepared.preparation_id)
  assert state == beam_job_api_pb2.JobState.FAILED
  (error,) = _errors(server, prepared.preparation_id)
  assert error.splitlines()[0].startswith('Out of memory: MemoryError'), error
