"""The job registry and the Job API over it, with a fake executor.

No Spark and no subprocess: a real in-process gRPC server serves
``JobService`` over a ``JobRegistry`` whose executor is a fake that the
test drives (start, emit messages, finish, fail). Whole-pipeline behaviour
through Spark is tested in test_jobservice.py; this is the state machine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent import futures

import apache_beam as beam
import grpc
import pytest
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_job_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.metrics import monitoring_infos
from apache_beam.runners.job import utils as job_utils
from apache_beam.transforms import environments

from beam_pyspark.events import Importance
from beam_pyspark.events import JobState
from beam_pyspark.events import MessageEvent
from beam_pyspark.events import StateEvent
from beam_pyspark.jobservice.jobs import JobRegistry
from beam_pyspark.jobservice.jobs import JobStateError
from beam_pyspark.jobservice.jobs import UnknownJobError
from beam_pyspark.jobservice.service import JobService
from beam_pyspark.jobservice.store import JobStore


def _pipeline():
  p = beam.Pipeline()
  _ = p | beam.Create([1, 2]) | beam.Map(str)
  return p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default())


class FakeExecution:
  """Stands in for PipelineExecution: the test moves it through states."""
  def __init__(self, job_id, pipeline, options, listener):
    self.job_id = job_id
    self.pipeline = pipeline
    self.options = options
    self.listener = listener
    self.started = threading.Event()
    self.cancelled = False
    self.committed_metrics = []
    self.attempted_metrics = []

  def start(self):
    if self.options.get('beam:option:bad:v1'):
      raise ValueError('bad option')
    self.started.set()
    self.emit(JobState.STARTING)
    self.emit(JobState.RUNNING)

  def cancel(self):
    self.cancelled = True
    self.emit(JobState.CANCELLING)
    self.emit(JobState.CANCELLED)

  def emit(self, state):
    self.listener(StateEvent(time.time(), state))

  def say(self, text, importance=Importance.JOB_MESSAGE_BASIC):
    self.listener(MessageEvent(time.time(), importance, text))


class Executor:
  def __init__(self):
    self.executions: dict[str, FakeExecution] = {}

  def __call__(self, job_id, pipeline, options, listener):
    execution = FakeExecution(job_id, pipeline, options, listener)
    self.executions[job_id] = execution
    return execution


def _counter(name, value):
  return monitoring_infos.int64_user_counter('ns', name, value)


@pytest.fixture
def executor():
  return Executor()


@contextlib.contextmanager
def _served(service):
  """A stub of ``service`` over a real gRPC server on a free port."""
  server = grpc.server(futures.ThreadPoolExecutor(8))
  beam_job_api_pb2_grpc.add_JobServiceServicer_to_server(service, server)
  port = server.add_insecure_port('127.0.0.1:0')
  server.start()
  channel = grpc.insecure_channel(f'127.0.0.1:{port}')
  try:
    yield beam_job_api_pb2_grpc.JobServiceStub(channel)
  finally:
    channel.close()
    server.stop(None)


@pytest.fixture
def api(executor, tmp_path):
  """(stub, service) over a real gRPC server on a free port."""
  service = JobService(executor, store=JobStore(str(tmp_path / 'jobs.sqlite')),
                       max_invocation_history=3)
  with _served(service) as stub:
    yield stub, service


def _prepare(stub, name='job', options=None):
  return stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
      pipeline=_pipeline(), job_name=name,
      pipeline_options=job_utils.dict_to_struct(options or {})))


def _state(stub, job_id):
  return stub.GetState(beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state


# -- the Job API over the registry ------------------------------------------


def test_prepare_run_done_through_grpc(api, executor):
  stub, _ = api
  prep = _prepare(stub, options={'beam:option:job_name:v1': 'mine'})
  assert prep.preparation_id.startswith('mine_')
  assert _state(stub, prep.preparation_id) == JobState.STOPPED
  job_id = stub.Run(beam_job_api_pb2.RunJobRequest(
      preparation_id=prep.preparation_id)).job_id
  execution = executor.executions[job_id]
  assert execution.started.is_set()
  assert _state(stub, job_id) == JobState.RUNNING
  execution.say('halfway')
  execution.emit(JobState.DONE)
  assert _state(stub, job_id) == JobState.DONE
  stream = list(stub.GetMessageStream(
      beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=10))
  states = [r.state_response.state for r in stream
            if r.HasField('state_response')]
  texts = [r.message_response.message_text for r in stream
           if r.HasField('message_response')]
  assert states == [JobState.STOPPED, JobState.STARTING, JobState.RUNNING,
                    JobState.DONE]
  assert 'halfway' in texts
  jobs = stub.GetJobs(beam_job_api_pb2.GetJobsRequest()).job_info
  assert [(j.job_id, j.job_name, j.state) for j in jobs] == [
      (job_id, 'mine', JobState.DONE)]


def test_state_stream_follows_a_live_job_until_it_ends(api, executor):
  stub, _ = api
  job_id = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  seen = []
  reader = threading.Thread(target=lambda: seen.extend(
      e.state for e in stub.GetStateStream(
          beam_job_api_pb2.GetJobStateRequest(job_id=job_id), timeout=10)))
  reader.start()
  time.sleep(0.2)
  assert reader.is_alive()  # a running job's stream stays open
  executor.executions[job_id].emit(JobState.FAILED)
  reader.join(10)
  assert not reader.is_alive()
  assert seen == [JobState.STOPPED, JobState.STARTING, JobState.RUNNING,
                  JobState.FAILED]


def test_streams_on_a_preparation_open_only_once_it_runs(api, executor):
  """As Beam's Java job service: Beam's Python client then opens them on
  Run's job id, without its job_server_timeout deadline."""
  stub, _ = api
  job_id = _prepare(stub).preparation_id
  for open_stream in (
      lambda: stub.GetStateStream(
          beam_job_api_pb2.GetJobStateRequest(job_id=job_id), timeout=10),
      lambda: stub.GetMessageStream(
          beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=10)):
    with pytest.raises(grpc.RpcError) as info:
      next(open_stream())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert job_id in info.value.details()
    assert 'not running' in info.value.details()
  assert _state(stub, job_id) == JobState.STOPPED
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  executor.executions[job_id].emit(JobState.DONE)
  assert [e.state for e in stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id=job_id), timeout=10)] == [
          JobState.STOPPED, JobState.STARTING, JobState.RUNNING,
          JobState.DONE]
  # A cancelled preparation's stream ends at once with its states.
  other = _prepare(stub).preparation_id
  stub.Cancel(beam_job_api_pb2.CancelJobRequest(job_id=other))
  assert [e.state for e in stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id=other), timeout=10)] == [
          JobState.STOPPED, JobState.CANCELLED]


def test_unknown_ids_are_not_found(api):
  stub, _ = api
  for call, request in [
      (stub.GetState, beam_job_api_pb2.GetJobStateRequest(job_id='nope')),
      (stub.Cancel, beam_job_api_pb2.CancelJobRequest(job_id='nope')),
      (stub.Run, beam_job_api_pb2.RunJobRequest(preparation_id='nope')),
      (stub.GetJobMetrics, beam_job_api_pb2.GetJobMetricsRequest(
          job_id='nope')),
  ]:
    with pytest.raises(grpc.RpcError) as info:
      call(request)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert 'nope' in info.value.details()
  with pytest.raises(grpc.RpcError) as info:
    list(stub.GetMessageStream(
        beam_job_api_pb2.JobMessagesRequest(job_id='nope')))
  assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_run_twice_is_refused(api):
  stub, _ = api
  job_id = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  with pytest.raises(grpc.RpcError) as info:
    stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_cancelled_preparation_is_not_run(api, executor):
  # Defect 2 of the hardening issue: Run after Cancel ran the pipeline.
  stub, _ = api
  job_id = _prepare(stub).preparation_id
  state = stub.Cancel(beam_job_api_pb2.CancelJobRequest(job_id=job_id)).state
  assert state == JobState.CANCELLED
  with pytest.raises(grpc.RpcError) as info:
    stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
  assert 'cancelled' in info.value.details()
  assert job_id not in executor.executions
  assert _state(stub, job_id) == JobState.CANCELLED


def test_cancel_reaches_the_running_execution(api, executor):
  stub, _ = api
  job_id = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  stub.Cancel(beam_job_api_pb2.CancelJobRequest(job_id=job_id))
  assert executor.executions[job_id].cancelled
  assert _state(stub, job_id) == JobState.CANCELLED


def test_an_option_the_executor_refuses_is_invalid_and_can_be_retried(
    api, executor):
  stub, _ = api
  job_id = _prepare(stub, options={'beam:option:bad:v1': True}).preparation_id
  with pytest.raises(grpc.RpcError) as info:
    stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert 'bad option' in info.value.details()
  assert _state(stub, job_id) == JobState.STOPPED


def test_live_metrics_while_running_and_final_after(api, executor):
  stub, _ = api
  job_id = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  execution = executor.executions[job_id]
  execution.committed_metrics = [_counter('seen', 5)]
  live = stub.GetJobMetrics(
      beam_job_api_pb2.GetJobMetricsRequest(job_id=job_id)).metrics
  assert [m.payload for m in live.committed] == [_counter('seen', 5).payload]
  execution.committed_metrics = [_counter('seen', 9)]
  execution.emit(JobState.DONE)
  execution.committed_metrics = []  # the registry kept the final ones
  final = stub.GetJobMetrics(
      beam_job_api_pb2.GetJobMetricsRequest(job_id=job_id)).metrics
  assert [m.payload for m in final.committed] == [
      _counter('seen', 9).payload]


def _run_done(stub, executor, n: int) -> list[str]:
  """The ids of ``n`` jobs prepared, run and DONE, in that order."""
  ids = []
  for _ in range(n):
    job_id = _prepare(stub).preparation_id
    stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
    executor.executions[job_id].emit(JobState.DONE)
    ids.append(job_id)
  return ids


def test_history_is_bounded_and_evicted_jobs_are_gone(api, executor):
  stub, _ = api
  ids = _run_done(stub, executor, 5)
  listed = [j.job_id for j in stub.GetJobs(
      beam_job_api_pb2.GetJobsRequest()).job_info]
  assert listed == ids[-3:]
  with pytest.raises(grpc.RpcError) as info:
    _state(stub, ids[0])
  assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_ended_job_joins_the_history_as_its_state_ends(api, executor):
  """The moment a job's DONE can be seen, the history is at its bound:
  collecting the ended job's final metrics (slow on a loaded machine) left
  it DONE but not yet counted, and a listing then showed eleven jobs in a
  history of ten (tests/test_concurrent_clients.py, in CI)."""
  stub, _ = api
  ids = _run_done(stub, executor, 3)
  last = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=last))
  collecting, release = threading.Event(), threading.Event()

  class SlowMetrics(list):
    def __iter__(self):
      collecting.set()
      release.wait(30)
      return super().__iter__()

  execution = executor.executions[last]
  execution.committed_metrics = SlowMetrics([_counter('c', 1)])
  ending = threading.Thread(target=execution.emit, args=(JobState.DONE, ))
  ending.start()
  try:
    assert collecting.wait(30)
    assert _state(stub, last) == beam_job_api_pb2.JobState.DONE
    listed = [j.job_id for j in stub.GetJobs(
        beam_job_api_pb2.GetJobsRequest()).job_info]
    assert listed == ids[-2:] + [last]
  finally:
    release.set()
    ending.join(30)
  with pytest.raises(grpc.RpcError) as info:
    _state(stub, ids[0])
  assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_describe_pipeline_options_lists_every_runner_option(api):
  stub, _ = api
  names = {o.name for o in stub.DescribePipelineOptions(
      beam_job_api_pb2.DescribePipelineOptionsRequest()).options}
  assert {'spark_master_url', 'spark_conf', 'spark_parallelism', 'drain',
          'split_stragglers_after_secs', 'group_memory_mb', 'status_port',
          'progress'} <= names


def test_ignored_options_are_said_at_prepare(api):
  stub, service = api
  job_id = _prepare(stub, options={
      'beam:option:spark_master_url:v1': 'spark://elsewhere:7077'
  }).preparation_id
  texts = [m.text for m in service.registry.messages(job_id)]
  assert any('spark_master_url' in t for t in texts), texts


# -- the registry and its store ---------------------------------------------


def test_history_and_messages_survive_a_restart(tmp_path, executor):
  path = str(tmp_path / 'jobs.sqlite')
  registry = JobRegistry(executor, store=JobStore(path))
  done = registry.prepare('a', _pipeline(), {}).job_id
  registry.run(done)
  executor.executions[done].say('the end is near')
  executor.executions[done].emit(JobState.DONE)
  running = registry.prepare('b', _pipeline(), {}).job_id
  registry.run(running)

  again = JobRegistry(Executor(), store=JobStore(path))
  assert again.state(done).state == JobState.DONE
  assert 'the end is near' in [m.text for m in again.messages(done)]
  # A job that was running when the server stopped did not finish, and
  # the reason is in its messages.
  assert again.state(running).state == JobState.FAILED
  assert any('stopped while this job was running' in m.text
             for m in again.messages(running))
  with pytest.raises(JobStateError):
    again.run(done)


def test_a_restart_trims_history_to_its_bound(tmp_path, executor):
  # Defect 6: a server restarted with a smaller bound kept every old job.
  path = str(tmp_path / 'jobs.sqlite')
  registry = JobRegistry(executor, store=JobStore(path),
                         max_invocation_history=10)
  ids = []
  for _ in range(6):
    job_id = registry.prepare('j', _pipeline(), {}).job_id
    registry.run(job_id)
    executor.executions[job_id].emit(JobState.DONE)
    ids.append(job_id)
  evicted = []
  again = JobRegistry(Executor(), store=JobStore(path),
                      max_invocation_history=2, on_evict=evicted.append)
  assert [j.job_id for j in again.jobs()] == ids[-2:]
  assert len(evicted) == 4
  assert len(JobStore(path).jobs()) == 2


def test_messages_kept_per_job_are_bounded(tmp_path, executor):
  # Defect 5: a chatty job grew the store without bound.
  store = JobStore(str(tmp_path / 'jobs.sqlite'), max_messages=50)
  registry = JobRegistry(executor, store=store)
  job_id = registry.prepare('chatty', _pipeline(), {}).job_id
  registry.run(job_id)
  for i in range(500):
    executor.executions[job_id].say(f'line {i}')
  kept = store.messages(job_id)
  assert len(kept) == 50
  assert kept[-1][2] == 'line 499'


def test_unknown_job_error_names_the_id():
  registry = JobRegistry(Executor())
  with pytest.raises(UnknownJobError, match='nope'):
    registry.state('nope')


def test_wait_returns_the_final_state(executor):
  registry = JobRegistry(executor)
  job_id = registry.prepare('w', _pipeline(), {}).job_id
  registry.run(job_id)
  assert registry.wait(job_id, timeout=0.05) == JobState.RUNNING
  threading.Timer(0.1, executor.executions[job_id].emit,
                  [JobState.DONE]).start()
  assert registry.wait(job_id, timeout=10) == JobState.DONE


# -- hostile pipelines at Prepare (the hardening issue, defects 1 and 8) -----


def _prepare_raw(stub, pipeline):
  return stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
      pipeline=pipeline, job_name='hostile'), timeout=10)


def _refused(stub, pipeline, match):
  started = time.monotonic()
  with pytest.raises(grpc.RpcError) as info:
    _prepare_raw(stub, pipeline)
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
      info.value.details())
  assert match in info.value.details(), info.value.details()
  assert time.monotonic() - started < 5
  # The server still answers.
  stub.GetJobs(beam_job_api_pb2.GetJobsRequest(), timeout=10)


def test_a_root_that_lists_itself_is_refused_at_once(api):
  stub, _ = api
  pipeline = _pipeline()
  root = pipeline.root_transform_ids[0]
  pipeline.components.transforms[root].subtransforms.append(root)
  _refused(stub, pipeline, 'lists itself as a subtransform')


def test_a_cycle_of_composites_is_refused(api):
  stub, _ = api
  pipeline = _pipeline()
  transforms = pipeline.components.transforms
  transforms['loop_a'].unique_name = 'LoopA'
  transforms['loop_b'].unique_name = 'LoopB'
  transforms['loop_a'].subtransforms.append('loop_b')
  transforms['loop_b'].subtransforms.append('loop_a')
  _refused(stub, pipeline, 'cycle')


def test_a_tree_that_repeats_a_child_is_refused_in_linear_time(api):
  # Each composite lists the same child twice: 2**40 leaves if walked.
  stub, _ = api
  pipeline = _pipeline()
  transforms = pipeline.components.transforms
  for level in range(40):
    transforms[f'c{level}'].unique_name = f'C{level}'
    transforms[f'c{level}'].subtransforms.extend([f'c{level + 1}'] * 2)
  transforms['c40'].unique_name = 'C40'
  pipeline.root_transform_ids.append('c0')
  _refused(stub, pipeline, 'appears twice in the transform tree')


def test_a_dangling_subtransform_is_refused(api):
  stub, _ = api
  pipeline = _pipeline()
  root = pipeline.root_transform_ids[0]
  pipeline.components.transforms[root].subtransforms.append('nowhere')
  _refused(stub, pipeline, "'nowhere' that is not among")


def test_an_empty_pipeline_is_prepared_and_a_rootless_one_refused(api):
  # An empty pipeline is Beam's (`with beam.Pipeline() as p: pass`, or one
  # whose every apply raised, as in Beam's YAML tests): its runners run it
  # to DONE. Transforms that no root reaches are still refused.
  stub, _ = api
  prep = _prepare_raw(stub, beam_runner_api_pb2.Pipeline())
  assert _state(stub, prep.preparation_id) == JobState.STOPPED
  rootless = beam_runner_api_pb2.Pipeline()
  rootless.components.transforms['t'].unique_name = 'Orphan'
  _refused(stub, rootless, 'no root transform')


def test_a_garbage_pardo_payload_is_invalid_not_internal(api):
  stub, _ = api
  pipeline = _pipeline()
  # The Map's ParDo (those inside Create's Reshuffle are runner-executed).
  (pardo,) = [t for t in pipeline.components.transforms.values()
              if t.spec.urn == 'beam:transform:pardo:v1' and
              t.unique_name.startswith('Map(str)')]
  pardo.spec.payload = b'\xff\xff\xff garbage'
  _refused(stub, pipeline, 'not a valid ParDoPayload')


# -- preparations and history bounds (defect 3) --------------------------------


def test_a_huge_job_name_is_refused(api):
  stub, _ = api
  with pytest.raises(grpc.RpcError) as info:
    _prepare(stub, name='n' * (1 << 20))
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert 'shorter --job_name' in info.value.details()
  assert len(info.value.details()) < 1000
  assert stub.GetJobs(beam_job_api_pb2.GetJobsRequest()).job_info == []


def test_preparations_are_bounded_apart_from_the_history(api, executor):
  stub, _ = api  # history of 3
  done = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=done))
  executor.executions[done].emit(JobState.DONE)
  # Issue 26: client A prepares, ten others prepare, A's Run found nothing.
  first = _prepare(stub).preparation_id
  others = [_prepare(stub).preparation_id for _ in range(10)]
  listed = [j.job_id for j in stub.GetJobs(
      beam_job_api_pb2.GetJobsRequest()).job_info]
  # No preparation pushed out another, nor the ended job (history of 3).
  assert listed == [done, first] + others
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=first))
  assert _state(stub, first) == JobState.RUNNING
  # Ending jobs trims the history to its bound: ended jobs only.
  for job_id in [first] + others[:4]:
    if job_id != first:
      stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
    executor.executions[job_id].emit(JobState.DONE)
  listed = [j.job_id for j in stub.GetJobs(
      beam_job_api_pb2.GetJobsRequest()).job_info]
  assert listed == others[1:]  # 3 ended, 6 prepared
  assert all(_state(stub, j) == JobState.STOPPED for j in others[4:])


def test_past_the_preparation_bound_prepare_is_refused(executor):
  service = JobService(executor, max_preparations=2, max_invocation_history=1,
                       preparation_timeout_secs=600,
                       max_preparations_per_client=2)
  with _served(service) as stub:
    kept = [_prepare(stub).preparation_id for _ in range(2)]
    with pytest.raises(grpc.RpcError) as info:
      _prepare(stub, name='third')
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert '--max-preparations 2' in info.value.details()
    assert '600 s' in info.value.details()
    # Both still run; once one has, there is room again.
    stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=kept[0]))
    assert _prepare(stub, name='fourth').preparation_id
    assert _state(stub, kept[1]) == JobState.STOPPED
    stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=kept[1]))
    assert _state(stub, kept[1]) == JobState.RUNNING


def test_a_running_job_is_never_dropped_for_preparations(api, executor):
  stub, _ = api
  running = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=running))
  for _ in range(6):
    _prepare(stub)
  listed = [j.job_id for j in stub.GetJobs(
      beam_job_api_pb2.GetJobsRequest()).job_info]
  assert running in listed
  assert _state(stub, running) == JobState.RUNNING


def test_a_preparation_not_run_in_time_expires(executor):
  now = [1000.0]
  registry = JobRegistry(executor, clock=lambda: now[0],
                         preparation_timeout_secs=60)
  stale = registry.prepare('old', _pipeline(), {}).job_id
  now[0] += 30
  fresh = registry.prepare('new', _pipeline(), {}).job_id
  now[0] += 31
  states = {j.job_id: j.state for j in registry.jobs()}
  assert states == {stale: JobState.FAILED, fresh: JobState.STOPPED}
  assert any('expired' in m.text for m in registry.messages(stale))
  with pytest.raises(JobStateError):
    registry.run(stale)
  registry.run(fresh)
  assert stale not in executor.executions


def test_get_jobs_stays_under_grpcs_default_message_size(api):
  stub, _ = api
  big = {'beam:option:blob:v1': 'x' * (900 << 10)}
  ids = [_prepare(stub, options=big).preparation_id for _ in range(3)]
  response = stub.GetJobs(beam_job_api_pb2.GetJobsRequest())
  assert [j.job_id for j in response.job_info] == ids
  assert response.ByteSize() < (4 << 20) - (64 << 10)
  # The newest jobs keep their options.
  assert response.job_info[-1].pipeline_options.fields['beam:option:blob:v1']


def test_oversized_options_are_refused(api):
  stub, _ = api
  with pytest.raises(grpc.RpcError) as info:
    _prepare(stub, options={'beam:option:blob:v1': 'x' * (2 << 20)})
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert 'pipeline options' in info.value.details()


def test_the_store_gives_an_evicted_jobs_pages_back(tmp_path, executor):
  # Defect 7: jobs.sqlite never shrank (475 MB holding 10 jobs).
  path = tmp_path / 'jobs.sqlite'
  registry = JobRegistry(executor, store=JobStore(str(path)),
                         max_invocation_history=1)
  chatty = registry.prepare('chatty', _pipeline(), {}).job_id
  registry.run(chatty)
  for i in range(300):
    executor.executions[chatty].say(f'{i} ' + 'x' * 20000)
  executor.executions[chatty].emit(JobState.DONE)
  full = path.stat().st_size + (tmp_path / 'jobs.sqlite-wal').stat().st_size
  # The next ended job pushes the chatty one out of the history.
  quiet = registry.prepare('quiet', _pipeline(), {}).job_id
  registry.run(quiet)
  executor.executions[quiet].emit(JobState.DONE)
  assert [j.job_id for j in registry.jobs()] == [quiet]
  import sqlite3
  with sqlite3.connect(path) as db:
    db.execute('PRAGMA wal_checkpoint(TRUNCATE)')
  assert full > 5_000_000
  assert path.stat().st_size < full / 4, (path.stat().st_size, full)


def test_progress_is_noted_only_when_not_the_default(api):
  stub, service = api
  quiet = _prepare(stub, options={'beam:option:progress:v1': 'auto'})
  asked = _prepare(stub, options={'beam:option:progress:v1': 'off'})
  assert not [m.text for m in service.registry.messages(
      quiet.preparation_id) if 'progress' in m.text]
  assert any('--progress=off is ignored' in m.text for m in
             service.registry.messages(asked.preparation_id))


def test_anyof_members_run_with_their_staged_files(executor, tmp_path):
  """An AnyOf environment's members' dependencies are rewritten to the
  staged files too: left as the client gave them, the driver would open
  the client's paths (or any path it names) on the job server's disk."""
  from apache_beam.portability import common_urns
  from apache_beam.runners.portability import artifact_service
  from beam_pyspark.artifacts.staging import ArtifactStagingService
  from jobserver_process import file_dependency
  source = tmp_path / 'client.txt'
  source.write_bytes(b'client bytes')
  member = environments.EmbeddedPythonEnvironment(
      capabilities=environments.python_sdk_capabilities(),
      artifacts=[file_dependency(str(source), 'client.txt')])
  p = beam.Pipeline()
  _ = p | beam.Create([1]) | beam.Map(str)
  pipeline = p.to_runner_api(
      default_environment=environments.AnyOfEnvironment([member]))
  staging = ArtifactStagingService(str(tmp_path / 'staged'))
  service = JobService(executor, staging=staging,
                       store=JobStore(str(tmp_path / 'jobs.sqlite')))
  with _served(service) as stub:
    prepared = stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
        pipeline=pipeline, job_name='anyof'))
    artifact_service.offer_artifacts(
        staging, artifact_service.ArtifactRetrievalService(
            artifact_service.BeamFilesystemHandler(None).file_reader),
        prepared.staging_session_token)
    stub.Run(beam_job_api_pb2.RunJobRequest(
        preparation_id=prepared.preparation_id))
  ran = executor.executions[prepared.preparation_id].pipeline
  paths = []
  for env in ran.components.environments.values():
    if env.urn == common_urns.environments.ANYOF.urn:
      for sub in beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
          env.payload).environments:
        paths.extend(beam_runner_api_pb2.ArtifactFilePayload.FromString(
            d.type_payload).path for d in sub.dependencies)
  assert paths and all(path.startswith(staging.root) for path in paths), paths
  assert [open(path, 'rb').read() for path in paths] == [b'client bytes']
  staging.close()


def test_a_client_is_its_peer_host():
  from beam_pyspark.jobservice.service import peer_host

  class Context:
    def __init__(self, peer):
      self._peer = peer

    def peer(self):
      return self._peer

  assert [peer_host(Context(p)) for p in (
      'ipv4:10.0.0.5:41234', 'ipv6:[::1]:5000', 'ipv6:%5B::1%5D:5000',
      'unix:/tmp/socket')] == ['10.0.0.5', '::1', '::1', 'unix']
  assert peer_host(None) == ''


def test_long_message_texts_are_cut_saying_so(api, executor):
  stub, _ = api
  job_id = _prepare(stub).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  executor.executions[job_id].say('é' * 100_000)  # 200,000 bytes
  executor.executions[job_id].emit(JobState.FAILED)
  texts = [r.message_response.message_text for r in stub.GetMessageStream(
      beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=10)
           if r.HasField('message_response')]
  (text, ) = [t for t in texts if t.startswith('é')]
  assert len(text.encode('utf-8')) <= 16384
  assert text.endswith('[... 200000 bytes in all; the rest was cut]')
