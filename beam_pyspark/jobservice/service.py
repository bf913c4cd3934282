"""Beam's Job API, served over gRPC.

The service knows nothing of Spark: it is handed an ``invoke`` function that
turns (job id, pipeline, options, listener) into an execution with
``start()``, ``cancel()``, ``state`` and metrics (as Prism's job server takes
an ``execute`` function), so tests can drive the whole API with a fake.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import uuid
from typing import Callable
from typing import Optional

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_job_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.portability.api import endpoints_pb2
from apache_beam.portability.api import metrics_pb2
from apache_beam.runners.job import utils as job_utils
from google.protobuf import timestamp_pb2

from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.jobservice.store import JobRecord
from beam_pyspark.jobservice.store import JobStore
from beam_pyspark.planning import check_supported
from beam_pyspark.planning import plan_pipeline

_LOGGER = logging.getLogger(__name__)

JobState = beam_job_api_pb2.JobState
TERMINAL = frozenset([
    JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.DRAINED,
    JobState.UPDATED
])
DEFAULT_MAX_INVOCATION_HISTORY = 10

# The options this runner understands, for DescribePipelineOptions.
RUNNER_OPTIONS = [
    beam_job_api_pb2.PipelineOptionDescriptor(
        name='spark_master_url',
        type=beam_job_api_pb2.PipelineOptionType.STRING,
        description='Spark master URL; the job server\'s own master is used '
        'when unset.',
        group='PySparkRunner'),
    beam_job_api_pb2.PipelineOptionDescriptor(
        name='spark_parallelism',
        type=beam_job_api_pb2.PipelineOptionType.INTEGER,
        description='Partitions per shuffle and for spreading SDF work.',
        group='PySparkRunner'),
]

Invoke = Callable[[str, beam_runner_api_pb2.Pipeline, dict, Callable], object]


class Refusal(Exception):
  """A request we refuse, with the gRPC status that says why."""
  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code
    self.message = message


def _unary(method):
  """Refusals become their status; anything else INTERNAL with its cause.

  Each call is isolated: a bad request never disturbs other jobs.
  """
  @functools.wraps(method)
  def wrapper(self, request, context=None):
    try:
      return method(self, request, context)
    except Refusal as r:
      if context is None:
        raise
      context.abort(r.code, r.message)
    except Exception as exn:  # pylint: disable=broad-except
      _LOGGER.exception('%s failed', method.__name__)
      if context is None:
        raise
      context.abort(
          grpc.StatusCode.INTERNAL,
          f'{method.__name__} failed: {type(exn).__name__}: {exn}')
  return wrapper


def _streaming(method):
  @functools.wraps(method)
  def wrapper(self, request, context=None):
    try:
      yield from method(self, request, context)
    except Refusal as r:
      if context is None:
        raise
      context.abort(r.code, r.message)
  return wrapper


def _timestamp(ts: float) -> timestamp_pb2.Timestamp:
  out = timestamp_pb2.Timestamp()
  out.FromNanoseconds(int(ts * 1e9))
  return out


def dependencies(pipeline: beam_runner_api_pb2.Pipeline):
  """Artifacts per environment, AnyOf environments expanded (as Beam's)."""
  result = {}
  for env_id, env in pipeline.components.environments.items():
    if env.urn == common_urns.environments.ANYOF.urn:
      subs = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
          env.payload).environments
    else:
      subs = [env]
    for i, sub in enumerate(subs):
      result[f'{i}:{env_id}'] = list(sub.dependencies)
  return result


class JobInvocation:
  """One prepared or running job: its events, guarded by a condition."""
  def __init__(self, job_id, job_name, pipeline, options, staging_token):
    self.job_id = job_id
    self.job_name = job_name
    self.pipeline = pipeline
    self.options = options
    self.staging_token = staging_token
    self.execution = None
    self.cond = threading.Condition()
    # ('state', ts, state) or ('message', ts, importance, text)
    self.events: list[tuple] = []
    self.states: list[tuple[float, int]] = []
    self.on_state: Optional[Callable[[float, int], None]] = None
    self._message_ids = 0

  @property
  def state(self) -> int:
    with self.cond:
      return self.states[-1][1] if self.states else JobState.UNSPECIFIED

  def record_state(self, state: int, ts: Optional[float] = None) -> None:
    ts = time.time() if ts is None else ts
    with self.cond:
      if self.states and (self.states[-1][1] == state or
                          self.states[-1][1] in TERMINAL):
        return
      self.states.append((ts, state))
      self.events.append(('state', ts, state))
      self.cond.notify_all()
    if self.on_state:
      self.on_state(ts, state)

  def record_message(self, ts: float, importance: int, text: str) -> None:
    with self.cond:
      self.events.append(('message', ts, importance, text))
      self.cond.notify_all()

  def listener(self, event) -> None:
    kind, payload = event
    if kind == 'state':
      self.record_state(payload)
    else:
      self.record_message(payload.timestamp, payload.importance, payload.text)

  def next_message_id(self) -> str:
    with self.cond:
      self._message_ids += 1
      return f'{self.job_id}-{self._message_ids}'


class JobService(beam_job_api_pb2_grpc.JobServiceServicer):
  def __init__(
      self,
      invoke: Invoke,
      staging=None,
      staging_endpoint: str = '',
      store: Optional[JobStore] = None,
      max_invocation_history: int = DEFAULT_MAX_INVOCATION_HISTORY):
    self._invoke = invoke
    self._staging = staging
    self._staging_endpoint = staging_endpoint
    self._store = store or JobStore()
    self._max_history = max_invocation_history
    self._lock = threading.Lock()
    self._jobs: dict[str, JobInvocation] = {}
    self._finished: collections.deque[str] = collections.deque()
    # Jobs of earlier runs of the server, from the store.
    self._past: dict[str, JobRecord] = {
        r.job_id: r for r in self._store.jobs()
    }
    self._mark_interrupted()

  def _mark_interrupted(self) -> None:
    """Jobs that were running when the server stopped did not finish."""
    for record in self._past.values():
      if record.states and record.states[-1][1] not in TERMINAL:
        ts = time.time()
        self._store.add_state(record.job_id, ts, JobState.FAILED)
        record.states.append((ts, JobState.FAILED))
      if record.states and record.states[-1][1] in TERMINAL:
        self._finished.append(record.job_id)

  # -- helpers ----------------------------------------------------------------

  def _job(self, job_id: str, context) -> JobInvocation:
    with self._lock:
      job = self._jobs.get(job_id)
    if job is None:
      raise Refusal(
          grpc.StatusCode.NOT_FOUND,
          f'No job or preparation with id {job_id!r}; GetJobs lists the '
          'known jobs.')
    return job

  def _finished_job(self, job: JobInvocation) -> None:
    if job.execution is not None:
      metrics = list(getattr(job.execution, 'committed_metrics', []))
      self._store.set_metrics(job.job_id, [m.SerializeToString() for m in metrics])
    with self._lock:
      self._finished.append(job.job_id)
      dropped = []
      while len(self._finished) > self._max_history:
        dropped.append(self._finished.popleft())
      for job_id in dropped:
        old = self._jobs.pop(job_id, None)
        record = self._past.pop(job_id, None)
        token = (old.staging_token if old else
                 record.staging_token if record else None)
        self._store.delete_job(job_id)
        if token and self._staging is not None:
          self._staging.remove_job(token)

  # -- Job API ----------------------------------------------------------------

  @_unary
  def Prepare(self, request, context=None):
    options = job_utils.struct_to_dict(request.pipeline_options)
    # Beam's Python client always sends job_name='job'; the user's
    # --job_name travels in the options.
    job_name = (options.get('beam:option:job_name:v1') or request.job_name or
                'job')
    preparation_id = f'{job_name}_{uuid.uuid4()}'
    try:
      check_supported(request.pipeline)
    except UnsupportedPipelineError as exn:
      raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exn)) from exn
    try:
      plan_pipeline(request.pipeline)  # a malformed pipeline fails here
    except Exception as exn:  # pylint: disable=broad-except
      raise Refusal(
          grpc.StatusCode.INVALID_ARGUMENT,
          f'The pipeline of job {job_name!r} is malformed: '
          f'{type(exn).__name__}: {exn}') from exn
    token = f'token-{preparation_id}'
    job = JobInvocation(
        preparation_id, job_name, request.pipeline, options, token)
    with self._lock:
      if preparation_id in self._jobs:
        raise Refusal(
            grpc.StatusCode.ALREADY_EXISTS,
            f'A job with preparation id {preparation_id!r} already exists.')
      self._jobs[preparation_id] = job
    job.on_state = (
        lambda ts, state, job_id=preparation_id: self._store.add_state(
            job_id, ts, state))
    self._store.put_job(
        JobRecord(
            job_id=preparation_id,
            job_name=job_name,
            options=options,
            created=time.time(),
            staging_token=token,
            pipeline=request.pipeline.SerializeToString()))
    job.record_state(JobState.STOPPED)
    if self._staging is not None:
      self._staging.register_job(token, dependencies(request.pipeline))
    return beam_job_api_pb2.PrepareJobResponse(
        preparation_id=preparation_id,
        artifact_staging_endpoint=endpoints_pb2.ApiServiceDescriptor(
            url=self._staging_endpoint),
        staging_session_token=token)

  @_unary
  def Run(self, request, context=None):
    job = self._job(request.preparation_id, context)
    if job.execution is not None:
      raise Refusal(
          grpc.StatusCode.FAILED_PRECONDITION,
          f'Job {job.job_id!r} was already run.')
    if self._staging is not None and any(dependencies(job.pipeline).values()):
      if not self._staging.is_staged(job.staging_token):
        raise Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f'Artifact staging for {job.job_id!r} has not finished: stage '
            'the artifacts with the staging token from Prepare, then Run.')
    pipeline = job.pipeline
    if self._staging is not None and any(dependencies(pipeline).values()):
      pipeline = _with_resolved_artifacts(
          pipeline, self._staging.resolved_artifacts(job.staging_token))
    try:
      execution = self._invoke(job.job_id, pipeline, job.options, job.listener)
    except ValueError as exn:  # a pipeline option we cannot honour
      raise Refusal(
          grpc.StatusCode.INVALID_ARGUMENT,
          f'Invalid pipeline option for job {job.job_id!r}: {exn}') from exn
    try:
      job.execution = execution
      threading.Thread(
          target=self._watch, args=(job, ), daemon=True,
          name=f'watch-{job.job_id}').start()
      execution.start()
    except UnsupportedPipelineError as exn:
      raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exn)) from exn
    return beam_job_api_pb2.RunJobResponse(job_id=job.job_id)

  def _watch(self, job: JobInvocation) -> None:
    with job.cond:
      while not (job.states and job.states[-1][1] in TERMINAL):
        job.cond.wait(1.0)
    self._finished_job(job)

  @_unary
  def GetState(self, request, context=None):
    with self._lock:
      job = self._jobs.get(request.job_id)
      record = self._past.get(request.job_id)
    if job is not None and job.states:
      ts, state = job.states[-1]
    elif record is not None and record.states:
      ts, state = record.states[-1]
    else:
      return self._job(request.job_id, context)
    return beam_job_api_pb2.JobStateEvent(state=state, timestamp=_timestamp(ts))

  @_streaming
  def GetStateStream(self, request, context=None):
    with self._lock:
      record = self._past.get(request.job_id)
    if record is not None and request.job_id not in self._jobs:
      for ts, state in record.states:
        yield beam_job_api_pb2.JobStateEvent(
            state=state, timestamp=_timestamp(ts))
      return
    job = self._job(request.job_id, context)
    index = 0
    while True:
      with job.cond:
        while index >= len(job.states) and (context is None or
                                            context.is_active()):
          job.cond.wait(1.0)
        pending = job.states[index:]
      if not pending:
        return  # the client went away
      for ts, state in pending:
        index += 1
        yield beam_job_api_pb2.JobStateEvent(
            state=state, timestamp=_timestamp(ts))
        if state in TERMINAL:
          return

  @_streaming
  def GetMessageStream(self, request, context=None):
    job = self._job(request.job_id, context)
    index = 0
    while True:
      with job.cond:
        while index >= len(job.events) and (context is None or
                                            context.is_active()):
          job.cond.wait(1.0)
        pending = job.events[index:]
      if not pending:
        return
      for event in pending:
        index += 1
        if event[0] == 'state':
          _, ts, state = event
          yield beam_job_api_pb2.JobMessagesResponse(
              state_response=beam_job_api_pb2.JobStateEvent(
                  state=state, timestamp=_timestamp(ts)))
          if state in TERMINAL:
            return
        else:
          _, ts, importance, text = event
          yield beam_job_api_pb2.JobMessagesResponse(
              message_response=beam_job_api_pb2.JobMessage(
                  message_id=job.next_message_id(),
                  time=str(int(ts * 1000)),
                  importance=importance,
                  message_text=text))

  @_unary
  def Cancel(self, request, context=None):
    job = self._job(request.job_id, context)
    if job.execution is None:
      job.record_state(JobState.CANCELLED)
      self._finished_job(job)
    elif job.state not in TERMINAL:
      job.execution.cancel()
    return beam_job_api_pb2.CancelJobResponse(state=job.state)

  @_unary
  def GetJobs(self, request, context=None):
    infos = []
    with self._lock:
      jobs = list(self._jobs.values())
      past = [r for r in self._past.values() if r.job_id not in self._jobs]
    for record in past:
      infos.append(
          beam_job_api_pb2.JobInfo(
              job_id=record.job_id,
              job_name=record.job_name,
              pipeline_options=job_utils.dict_to_struct(record.options),
              state=record.states[-1][1] if record.states else
              JobState.UNSPECIFIED))
    for job in jobs:
      infos.append(
          beam_job_api_pb2.JobInfo(
              job_id=job.job_id,
              job_name=job.job_name,
              pipeline_options=job_utils.dict_to_struct(job.options),
              state=job.state))
    return beam_job_api_pb2.GetJobsResponse(job_info=infos)

  @_unary
  def GetPipeline(self, request, context=None):
    with self._lock:
      record = self._past.get(request.job_id)
    if record is not None and request.job_id not in self._jobs:
      return beam_job_api_pb2.GetJobPipelineResponse(
          pipeline=beam_runner_api_pb2.Pipeline.FromString(record.pipeline))
    job = self._job(request.job_id, context)
    return beam_job_api_pb2.GetJobPipelineResponse(pipeline=job.pipeline)

  @_unary
  def GetJobMetrics(self, request, context=None):
    with self._lock:
      record = self._past.get(request.job_id)
    if record is not None and request.job_id not in self._jobs:
      infos = [metrics_pb2.MonitoringInfo.FromString(m) for m in record.metrics]
      return beam_job_api_pb2.GetJobMetricsResponse(
          metrics=beam_job_api_pb2.MetricResults(
              attempted=infos, committed=infos))
    job = self._job(request.job_id, context)
    execution = job.execution
    committed = list(getattr(execution, 'committed_metrics', []) or [])
    attempted = list(getattr(execution, 'attempted_metrics', []) or committed)
    return beam_job_api_pb2.GetJobMetricsResponse(
        metrics=beam_job_api_pb2.MetricResults(
            attempted=attempted, committed=committed))

  @_unary
  def DescribePipelineOptions(self, request, context=None):
    return beam_job_api_pb2.DescribePipelineOptionsResponse(
        options=RUNNER_OPTIONS)


def _with_resolved_artifacts(pipeline, resolved):
  """The pipeline with each environment's dependencies as staged files."""
  pipeline = beam_runner_api_pb2.Pipeline.FromString(
      pipeline.SerializeToString())
  for env_id, env in pipeline.components.environments.items():
    deps = resolved.get(f'0:{env_id}')
    if deps is not None and env.urn != common_urns.environments.ANYOF.urn:
      del env.dependencies[:]
      env.dependencies.extend(deps)
  return pipeline
