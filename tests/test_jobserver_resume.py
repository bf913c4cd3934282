"""Streaming jobs across job-server restarts.

A real ``beam-pyspark job-server`` subprocess on local[2], Beam's
PortableRunner client submitting a streaming job (an unbounded splittable
read over many micro-batches into windowed sums, an idempotent sink; a
stateful DoFn across a driver's death is test_streaming_recovery.py's):
SIGTERM stops it between micro-batches and the next server resumes it;
SIGKILL kills it and the next server resumes it; it ends DONE with Beam's
DirectRunner's output. Then the rules behind it with a fake executor (no
Spark): which unfinished jobs a start resumes and which end FAILED, what
SIGTERM does to streaming and batch jobs, where checkpoints live and when
they go.
"""

from __future__ import annotations

import os
import signal
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from beam_pyspark.events import Importance
from beam_pyspark.events import JobState
from beam_pyspark.jobservice.jobs import JobRegistry
from beam_pyspark.jobservice.recovery import StreamingRecovery
from beam_pyspark.jobservice.store import JobStore
from beam_pyspark.options import RunnerOptions
from beam_pyspark.spark.checkpoints import CheckpointDir
from beam_pyspark.streaming.checkpoints import ManifestBook
from jobserver_process import JobServerProcess
from test_registry import Executor
from test_registry import FakeExecution
from test_registry import _pipeline

import streaming_recovery_job as job

EMBEDDED = 'beam:env:embedded_python:v1'
TESTS = os.path.dirname(os.path.abspath(__file__))
STREAMING = {'beam:option:streaming:v1': True}
RESUMED = 'Resumed from its checkpoint after the job server restarted: '

# -- a real job server, killed and stopped under a streaming job ----------------


def _server(root):
  # The job's DoFns live in streaming_recovery_job: importable by the
  # server's workers, as a user's installed package would be.
  # Spark warmed up at start, as by default: the resumed job starts while
  # the warm-up does (both ask for the one SparkContext).
  return JobServerProcess(root, env={'PYTHONPATH': TESTS}, spark_warm_up=True)


def _committed(checkpoint) -> list[int]:
  directory = os.path.join(checkpoint, 'manifests')
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _wait_for_commit(server, checkpoint, after: int, timeout=240) -> int:
  """Waits until a micro-batch past ``after`` committed; its number."""
  deadline = time.monotonic() + timeout
  while not [b for b in _committed(checkpoint) if b > after]:
    assert server.proc.poll() is None, server.log()
    assert time.monotonic() < deadline, (
        f'no micro-batch after {after} committed:\n{server.log()}')
    time.sleep(0.05)
  return max(_committed(checkpoint))


def _history(server, job_id, until=None):
  """(states, message texts) of the job as ``server`` serves them: to its
  end, or until a message satisfies ``until``."""
  texts, states = [], []
  stream = server.job_stub.GetMessageStream(
      beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=60)
  try:
    for response in stream:
      if response.HasField('message_response'):
        texts.append(response.message_response.message_text)
        if until is not None and until(texts[-1]):
          break
      else:
        states.append(response.state_response.state)
  finally:
    stream.cancel()
  return states, texts


def _state(server, job_id):
  return server.job_stub.GetState(
      beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state


def _why(server, job_id, state) -> str:
  """The job's state and messages as ``server`` serves them, then the
  end of the servers' shared log (all three runs append to it)."""
  texts = []
  stream = server.job_stub.GetMessageStream(
      beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=5)
  try:  # a job not ended streams on: what 5 s gave
    for response in stream:
      if response.HasField('message_response'):
        texts.append(response.message_response.message_text)
  except Exception as exn:  # pylint: disable=broad-except
    texts.append(f'({type(exn).__name__} reading the messages)')
  return (f'state {beam_job_api_pb2.JobState.Enum.Name(state)}; messages:\n'
          + '\n'.join(t[-2000:] for t in texts[-8:]) +
          f'\n--- end of the servers\' log ---\n{server.log()[-4000:]}')


def _resumed_after(texts) -> int:
  """The micro-batch the job's last resumption went on after."""
  marker = RESUMED + 'micro-batch '
  found = [t for t in texts if t.startswith(marker)]
  assert found, texts
  return int(found[-1][len(marker):].split()[0])


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """Beam's DirectRunner's output: its batch mode reads each restriction
  to its end, and the watermark alone decides these panes."""
  out = tmp_path_factory.mktemp('direct')
  with beam.Pipeline('DirectRunner') as p:
    job.build_sums(p, str(out))
  expected = job.read_output(str(out))
  assert len(expected) > 20, 'the reference is too small to judge by'
  return expected


def test_a_streaming_job_survives_sigterm_and_sigkill_of_its_job_server(
    tmp_path, reference):
  root, out = tmp_path / 'server', tmp_path / 'out'
  out.mkdir()
  first = _server(root)
  try:
    p = beam.Pipeline(options=PipelineOptions([
        '--runner=PortableRunner', f'--job_endpoint={first.job_endpoint}',
        f'--environment_type={EMBEDDED}', '--streaming',
        f'--max_records_per_batch={job.SDF_BUDGET}', '--job_name=resumed']))
    job.build_sums(p, str(out))
    job_id = p.run()._job_id  # pylint: disable=protected-access
    checkpoint = StreamingRecovery(str(root)).owned(job_id)
    _wait_for_commit(first, checkpoint, after=0)
    first.proc.send_signal(signal.SIGTERM)
    # Well inside Kubernetes' 30 s before SIGKILL.
    assert first.proc.wait(25) == 0, first.log()
  finally:
    first.stop()
  stopped_at = max(_committed(checkpoint))

  second = _server(root)
  try:
    _, texts = _history(second, job_id, until=lambda t: t.startswith(RESUMED))
    resumed = _resumed_after(texts)
    assert resumed == stopped_at
    killed_at = _wait_for_commit(second, checkpoint, after=resumed)
    second.proc.kill()
    second.proc.wait(30)
  finally:
    second.stop()

  third = _server(root)
  try:
    deadline = time.monotonic() + 240
    while (state := _state(third, job_id)) != beam_job_api_pb2.JobState.DONE:
      assert state in (beam_job_api_pb2.JobState.STARTING,
                       beam_job_api_pb2.JobState.RUNNING), _why(
                           third, job_id, state)
      assert time.monotonic() < deadline, _why(third, job_id, state)
      time.sleep(0.5)
    states, texts = _history(third, job_id)
  finally:
    third.stop()
  assert _resumed_after(texts) >= killed_at
  assert any('SIGTERM' in t and 'between micro-batches' in t
             for t in texts), texts
  # Ran, stopped (SIGTERM), ran again (twice), done.
  assert states[-1] == beam_job_api_pb2.JobState.DONE
  assert beam_job_api_pb2.JobState.STOPPED in states[1:], states
  assert states.count(beam_job_api_pb2.JobState.RUNNING) == 3, states
  assert job.read_output(str(out)) == reference
  assert not os.path.exists(checkpoint), 'a DONE job keeps no checkpoint'


# -- the rules, with a fake executor (no Spark) ---------------------------------
#
# The executor stands in for the job server's (server.spark_invoke): it
# places the job's checkpoint with the real StreamingRecovery; its
# executions are the fakes of test_registry, which stop as the streaming
# engine does when interrupted (they end STOPPED). That a real engine stops,
# keeps its checkpoint and resumes from it is the job-server test above.


class _Interruptible(FakeExecution):
  stops = True  # False: asked to stop, it never does

  def interrupt(self, reason):
    if not RunnerOptions.from_job_options(self.options).streaming:
      return False
    self.say(f'{reason}: stopping')
    if self.stops:
      self.emit(JobState.STOPPED)
    return True


class _Executor(Executor):
  def __init__(self, recovery):
    super().__init__()
    self.recovery = recovery
    self.locations = {}

  def __call__(self, job_id, pipeline, options, listener):
    runner_options = RunnerOptions.from_job_options(options)
    self.recovery.assign(job_id, pipeline, runner_options)
    self.locations[job_id] = runner_options.checkpoint_location
    execution = _Interruptible(job_id, pipeline, options, listener)
    self.executions[job_id] = execution
    return execution


def _commit(location, batch):
  """A committed micro-batch in the checkpoint at ``location``, as the
  streaming engine writes it (spark.checkpoints)."""
  CheckpointDir(location).commit(ManifestBook('fp').commit(batch, {}))


def _registry(tmp_path, **kwargs):
  recovery = StreamingRecovery(str(tmp_path / 'artifacts'))
  executor = _Executor(recovery)
  registry = JobRegistry(executor, store=JobStore(str(tmp_path / 'jobs.db')),
                         recovery=recovery, **kwargs)
  return registry, executor


def _run(registry, name, options):
  job_id = registry.prepare(name, _pipeline(), options).job_id
  registry.run(job_id)
  return job_id


def _texts(registry, job_id):
  return [m.text for m in registry.messages(job_id)]


def test_a_start_resumes_running_streaming_jobs_and_fails_the_rest(tmp_path):
  registry, executor = _registry(tmp_path)
  streaming = _run(registry, 'streaming', STREAMING)
  _commit(executor.locations[streaming], 4)
  batch = _run(registry, 'batch', {})
  gone = _run(registry, 'gone', STREAMING)
  os.rmdir(executor.locations[gone])
  cancelling = _run(registry, 'cancelling', STREAMING)
  executor.executions[cancelling].emit(JobState.CANCELLING)
  prepared = registry.prepare('prepared', _pipeline(), STREAMING).job_id

  # The server is killed: a new one starts on the same store.
  again, executor2 = _registry(tmp_path)
  assert again.resumable() == [streaming]
  assert again.state(streaming).state == JobState.RUNNING
  for job_id in (batch, cancelling):
    assert again.state(job_id).state == JobState.FAILED
    assert any('stopped while this job was running' in t
               for t in _texts(again, job_id))
  assert again.state(gone).state == JobState.FAILED
  assert any(executor.locations[gone] in t and 'is gone' in t
             for t in _texts(again, gone)), _texts(again, gone)
  assert again.state(prepared).state == JobState.FAILED
  assert not os.path.exists(executor.locations[gone])

  again.resume(streaming)
  execution = executor2.executions[streaming]
  assert execution.started.is_set()
  assert executor2.locations[streaming] == executor.locations[streaming]
  assert (RESUMED + 'micro-batch 4 was the last one committed (to '
          f'{executor.locations[streaming]}); the job goes on after it.'
          ) in _texts(again, streaming)
  execution.emit(JobState.DONE)
  assert [e.state for e in again.subscribe(streaming, messages=False)] == [
      JobState.STOPPED, JobState.STARTING, JobState.RUNNING,
      JobState.STARTING, JobState.RUNNING, JobState.DONE]
  assert again.resumable() == []


def test_sigterm_stops_streaming_jobs_to_resume_and_cancels_batch_ones(
    tmp_path):
  registry, executor = _registry(tmp_path)
  streaming = _run(registry, 'streaming', STREAMING)
  batch = _run(registry, 'batch', {})
  started = time.monotonic()
  registry.shutdown(0.5, 'The job server is stopping (SIGTERM)')
  assert time.monotonic() - started < 5
  assert registry.state(streaming).state == JobState.STOPPED
  assert not executor.executions[streaming].cancelled
  assert os.path.isdir(executor.locations[streaming])
  assert registry.state(batch).state == JobState.CANCELLED

  again, executor2 = _registry(tmp_path)
  assert again.resumable() == [streaming]
  assert again.state(batch).state == JobState.CANCELLED
  again.resume(streaming)
  assert executor2.executions[streaming].started.is_set()
  assert any(t.startswith('Resumed after the job server restarted: no '
                          'micro-batch had committed')
             for t in _texts(again, streaming)), _texts(again, streaming)


def test_a_streaming_job_that_does_not_stop_is_left_stopped_for_the_next_start(
    tmp_path):
  registry, executor = _registry(tmp_path)
  stuck = _run(registry, 'stuck', STREAMING)
  executor.executions[stuck].stops = False
  registry.shutdown(0, 'The job server is stopping', cancel_wait_secs=0.2)
  assert registry.state(stuck).state == JobState.STOPPED
  assert any('did not stop within' in t for t in _texts(registry, stuck))
  # Its execution, which the process's end would stop, is not heard from.
  executor.executions[stuck].emit(JobState.FAILED)
  assert registry.state(stuck).state == JobState.STOPPED
  again, _ = _registry(tmp_path)
  assert again.resumable() == [stuck]


def test_a_job_that_cannot_resume_ends_failed_saying_why(tmp_path):
  registry, executor = _registry(tmp_path)
  refused = _run(registry, 'refused', STREAMING)
  unstaged = _run(registry, 'unstaged', STREAMING)
  again, executor2 = _registry(tmp_path)
  assert again.resumable() == [refused, unstaged]

  def resolve(job_id):
    if job_id == unstaged:
      raise RuntimeError('its staged files were missing at start-up')
    return again.pipeline(job_id)

  again.resume(refused, resolve)
  again.resume(unstaged, resolve)
  assert again.state(unstaged).state == JobState.FAILED
  assert ('Could not resume the job after the job server restarted: '
          'RuntimeError: its staged files were missing at start-up'
          ) in _texts(again, unstaged)
  # The engine refuses a checkpoint of another pipeline when it resumes
  # (tests/test_streaming_recovery.py): its error ends the job FAILED.
  execution = executor2.executions[refused]
  execution.say('CheckpointMismatch: the checkpoint holds another pipeline',
                Importance.JOB_MESSAGE_ERROR)
  execution.emit(JobState.FAILED)
  assert again.state(refused).state == JobState.FAILED
  assert again.resumable() == []


def test_checkpoints_live_under_the_artifacts_dir_until_the_job_leaves_history(
    tmp_path):
  registry, executor = _registry(tmp_path, max_invocation_history=1)
  own = str(tmp_path / 'users-own')
  batch = _run(registry, 'batch', {})
  streaming = _run(registry, 'streaming', STREAMING)
  users = _run(registry, 'users', {
      **STREAMING, 'beam:option:checkpoint_location:v1': own})
  assert executor.locations[batch] is None
  location = executor.locations[streaming]
  assert os.path.dirname(location) == str(tmp_path / 'artifacts' /
                                          'checkpoints')
  assert os.path.isdir(location)
  assert executor.locations[users] == own and os.path.isdir(own)
  # A failed job keeps its checkpoint while it is in the history.
  executor.executions[streaming].emit(JobState.FAILED)
  assert os.path.isdir(location)
  executor.executions[users].emit(JobState.FAILED)
  assert registry.jobs()[-1].job_id == users
  assert not os.path.exists(location), 'evicted with its job'
  executor.executions[batch].emit(JobState.DONE)
  assert os.path.isdir(own), 'a location of the job\'s own is the user\'s'


def test_a_checkpoint_directory_name_is_bounded_and_unique(tmp_path):
  recovery = StreamingRecovery(str(tmp_path))
  long_a = 'a/b' * 100 + '_1'
  long_b = 'a/b' * 100 + '_2'
  names = {os.path.basename(recovery.owned(i)) for i in (long_a, long_b)}
  assert len(names) == 2
  assert all(len(n) < 128 and '/' not in n for n in names)
  assert all(os.path.dirname(recovery.owned(i)) == recovery.root
             for i in (long_a, long_b, '..'))


def test_only_a_streaming_execution_with_a_checkpoint_stops_to_resume(
    tmp_path):
  from beam_pyspark.execution import PipelineExecution
  said = []
  streaming = PipelineExecution(
      _pipeline(), RunnerOptions(streaming=True,
                                 checkpoint_location=str(tmp_path)),
      'streaming', said.append)
  assert streaming.interrupt('The job server is stopping (SIGTERM)')
  assert any('between micro-batches' in e.text for e in said)
  assert not streaming.interrupt('again'), 'asked once'
  # A batch job, and a streaming one whose checkpoint nobody keeps,
  # cannot resume: the server cancels them instead.
  assert not PipelineExecution(
      _pipeline(), RunnerOptions(checkpoint_location=str(tmp_path))
  ).interrupt('SIGTERM')
  assert not PipelineExecution(
      _pipeline(), RunnerOptions(streaming=True)).interrupt('SIGTERM')


def test_a_job_cancelled_before_it_resumes_is_not_run(tmp_path):
  registry, _ = _registry(tmp_path)
  early = _run(registry, 'early', STREAMING)
  late = _run(registry, 'late', STREAMING)
  again, executor2 = _registry(tmp_path)
  again.cancel(early)
  again.resume(early)
  assert again.state(early).state == JobState.CANCELLED
  assert early not in executor2.executions
  # Cancelled while its execution is being built (a client's Cancel as the
  # server starts): never started.
  build = executor2.__call__

  def cancelling(job_id, *args):
    execution = build(job_id, *args)
    again.cancel(job_id)
    return execution

  again._invoke = cancelling  # pylint: disable=protected-access
  again.resume(late)
  assert again.state(late).state == JobState.CANCELLED
  assert not executor2.executions[late].started.is_set()
