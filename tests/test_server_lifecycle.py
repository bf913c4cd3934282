"""The job server stopping: SIGTERM lets running jobs finish within a grace
period, cancels the rest and records why; after a SIGKILL, the next start
says so. A real job-server subprocess, real Spark, Beam's PortableRunner
client; plus the registry's rules with a fake executor."""

from __future__ import annotations

import signal
import threading
import time

import apache_beam as beam
import grpc
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from beam_pyspark.events import JobState
from beam_pyspark.jobservice.jobs import JobRegistry
from beam_pyspark.jobservice.jobs import ShuttingDownError
from jobserver_process import JobServerProcess
from test_registry import Executor
from test_registry import _pipeline

EMBEDDED = 'beam:env:embedded_python:v1'


# -- the registry's rules ---------------------------------------------------------


def test_shutdown_lets_jobs_finish_then_cancels_the_rest():
  executor = Executor()
  registry = JobRegistry(executor)
  quick = registry.prepare('quick', _pipeline(), {}).job_id
  slow = registry.prepare('slow', _pipeline(), {}).job_id
  idle = registry.prepare('idle', _pipeline(), {}).job_id
  registry.run(quick)
  registry.run(slow)
  threading.Timer(0.2, executor.executions[quick].emit,
                  [JobState.DONE]).start()
  started = time.monotonic()
  registry.shutdown(1.0, 'The job server is stopping (SIGTERM)')
  assert 0.9 <= time.monotonic() - started < 5
  assert registry.state(quick).state == JobState.DONE
  assert registry.state(slow).state == JobState.CANCELLED
  assert executor.executions[slow].cancelled
  assert any('stopping (SIGTERM)' in m.text and 'grace period' in m.text
             for m in registry.messages(slow))
  assert registry.state(idle).state == JobState.CANCELLED
  assert any('never run' in m.text for m in registry.messages(idle))
  with pytest.raises(ShuttingDownError):
    registry.prepare('late', _pipeline(), {})


def test_a_job_that_ignores_its_cancel_ends_failed():
  executor = Executor()
  registry = JobRegistry(executor)
  stuck = registry.prepare('stuck', _pipeline(), {}).job_id
  registry.run(stuck)
  executor.executions[stuck].cancel = lambda: None  # never stops
  registry.shutdown(0.1, 'The job server is stopping', cancel_wait_secs=0.2)
  assert registry.state(stuck).state == JobState.FAILED
  assert any('did not stop' in m.text for m in registry.messages(stuck))


# -- a real job server --------------------------------------------------------------


def _submit_sleeping_job(server, seconds):
  """A job that runs ``seconds``; Beam's client submits it, not waiting."""
  p = beam.Pipeline(options=PipelineOptions([
      '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
      f'--environment_type={EMBEDDED}', '--job_name=sleepy']))
  _ = (p | beam.Create([seconds])
       | beam.Map(lambda s: __import__('time').sleep(s) or s))
  result = p.run()
  deadline = time.monotonic() + 120
  while result.state != beam.runners.runner.PipelineState.RUNNING:
    assert time.monotonic() < deadline, result.state
    time.sleep(0.2)
  return result._job_id  # pylint: disable=protected-access


def _messages(stub, job_id):
  return [r.message_response.message_text
          for r in stub.GetMessageStream(
              beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=30)
          if r.HasField('message_response')]


def _after_restart(root, job_id):
  """(state, message texts) of ``job_id`` as a new server on ``root`` sees
  them."""
  server = JobServerProcess(root)
  try:
    state = server.job_stub.GetState(
        beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
    return state, _messages(server.job_stub, job_id)
  finally:
    server.stop()


def test_sigterm_cancels_a_running_job_and_says_so_after_a_restart(tmp_path):
  root = tmp_path / 'server'
  first = JobServerProcess(root, '--shutdown-grace-secs', '2')
  try:
    job_id = _submit_sleeping_job(first, 600)
    started = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(60) == 0
    # Well inside Kubernetes' 30 s before SIGKILL.
    assert time.monotonic() - started < 25
  finally:
    first.stop()
  state, texts = _after_restart(root, job_id)
  assert state == beam_job_api_pb2.JobState.CANCELLED, texts
  assert any('stopping (SIGTERM)' in t for t in texts), texts


def test_after_sigkill_the_next_start_says_the_job_did_not_finish(tmp_path):
  root = tmp_path / 'server'
  first = JobServerProcess(root)
  try:
    job_id = _submit_sleeping_job(first, 600)
    first.proc.kill()
    first.proc.wait(30)
  finally:
    first.stop()
  state, texts = _after_restart(root, job_id)
  assert state == beam_job_api_pb2.JobState.FAILED
  assert any('stopped while this job was running' in t for t in texts), texts


def test_prepare_is_unavailable_while_stopping():
  from beam_pyspark.jobservice.service import JobService
  from beam_pyspark.jobservice.service import Refusal
  service = JobService(Executor())
  service.registry.shutdown(0, 'stopping')
  with pytest.raises(Refusal) as info:
    # Without a gRPC context the refusal is raised as is.
    service.Prepare(beam_job_api_pb2.PrepareJobRequest(
        pipeline=_pipeline(), job_name='late'))
  assert info.value.code == grpc.StatusCode.UNAVAILABLE
  assert 'stopping' in info.value.message


def test_a_second_server_on_a_held_port_exits_naming_it(tmp_path):
  """gRPC's default SO_REUSEPORT let two job servers bind one port, each
  then getting some of its clients; ours are exclusive, and a port held
  fails the start, naming it and its flag."""
  import subprocess
  import sys
  first = JobServerProcess(tmp_path / 'first')
  try:
    ports = {flag: int(first.endpoints[name].rsplit(':', 1)[1])
             for flag, name in (('--job-port', 'job'),
                                ('--artifact-port', 'artifact'),
                                ('--expansion-port', 'expansion'))}
    for flag, port in ports.items():
      args = {'--job-port': '0', '--artifact-port': '0',
              '--expansion-port': '0', flag: str(port)}
      second = subprocess.run(
          [sys.executable, '-m', 'beam_pyspark.cli', 'job-server',
           *[x for kv in args.items() for x in kv], '--status-port', '-1',
           '--no-spark-warm-up',
           '--artifacts-dir', str(tmp_path / f'second{flag}')],
          capture_output=True, text=True, timeout=120, check=False)
      assert second.returncode != 0, (flag, second.stdout, second.stderr)
      assert f'port {port} is in use' in second.stderr, second.stderr
      assert flag in second.stderr, second.stderr
      assert 'listening' not in second.stdout
    # The first still serves, alone on its ports.
    first.job_stub.GetJobs(beam_job_api_pb2.GetJobsRequest(), timeout=30)
  finally:
    first.stop()
