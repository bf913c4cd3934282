"""Beam's Job API, served over gRPC: a thin adapter over the job registry.

Requests become calls on ``JobRegistry`` (jobs.py), which owns every job's
state; its answers become responses, and its errors gRPC status codes. The
service knows nothing of Spark: the registry is handed an ``invoke``
function that turns (job id, pipeline, options, listener) into an
execution (as Prism's job server takes an ``execute`` function), so tests
drive the whole API with a fake.
"""

from __future__ import annotations

import functools
import logging
import urllib.parse
from typing import Optional
from typing import Sequence

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_job_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.portability.api import endpoints_pb2
from apache_beam.runners.job import utils as job_utils
from google.protobuf import timestamp_pb2

from beam_pyspark.artifacts.retrieval import bounded
from beam_pyspark.artifacts.urls import UrlNotAllowedError
from beam_pyspark.artifacts.urls import UrlPolicy
from beam_pyspark.artifacts.urls import artifact_url
from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.events import MessageEvent
from beam_pyspark.events import StateEvent
from beam_pyspark.jobservice.jobs import DEFAULT_MAX_INVOCATION_HISTORY
from beam_pyspark.jobservice.jobs import DEFAULT_MAX_PREPARATIONS
from beam_pyspark.jobservice.jobs import DEFAULT_PREPARATION_TIMEOUT_SECS
from beam_pyspark.jobservice.jobs import Invoke
from beam_pyspark.jobservice.jobs import JobRegistry
from beam_pyspark.jobservice.jobs import JobStateError
from beam_pyspark.jobservice.jobs import ShuttingDownError
from beam_pyspark.jobservice.jobs import TooManyPreparationsError
from beam_pyspark.jobservice.jobs import UnknownJobError
from beam_pyspark.jobservice.recovery import StreamingRecovery
from beam_pyspark.jobservice.store import JobStore
from beam_pyspark import options as options_module
from beam_pyspark.options import ignored_by_job_server
from beam_pyspark.options import RunnerOptions
from beam_pyspark.options import runner_options
from beam_pyspark.planning import check_supported
from beam_pyspark.planning import plan_pipeline
from beam_pyspark.planning.environments import EnvironmentOverride
from beam_pyspark.planning.environments import apply_overrides
from beam_pyspark.planning.environments import parse_all as parse_overrides
from beam_pyspark.redaction import redact_options

_LOGGER = logging.getLogger(__name__)

__all__ = ['JobService', 'DEFAULT_MAX_INVOCATION_HISTORY', 'Refusal']

_OPTION_TYPES = {
    'string': beam_job_api_pb2.PipelineOptionType.STRING,
    'integer': beam_job_api_pb2.PipelineOptionType.INTEGER,
    'number': beam_job_api_pb2.PipelineOptionType.NUMBER,
    'boolean': beam_job_api_pb2.PipelineOptionType.BOOLEAN,
    'array': beam_job_api_pb2.PipelineOptionType.ARRAY,
}


# A job's pipeline options, as sent at Prepare, at most (Beam's clients send
# a few KB).
MAX_OPTIONS_BYTES = 1 << 20
# One message's text on the message stream, at most (a traceback of
# thousands of lines is cut, saying so): every message of a job's history
# is sent again to each new stream.
MAX_MESSAGE_TEXT_BYTES = 16384
# What GetJobs spends on options, over all jobs: the rest of gRPC's default
# 4 MB limit is ample for ids, names and states.
GET_JOBS_OPTIONS_BYTES = 2 << 20


class Refusal(Exception):
  """A request we refuse, with the gRPC status that says why."""
  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code
    self.message = message


def _refusal(exn: BaseException) -> Optional[Refusal]:
  if isinstance(exn, Refusal):
    return exn
  if isinstance(exn, UnknownJobError):
    return Refusal(grpc.StatusCode.NOT_FOUND, str(exn))
  if isinstance(exn, JobStateError):
    return Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(exn))
  if isinstance(exn, ShuttingDownError):
    return Refusal(grpc.StatusCode.UNAVAILABLE, str(exn))
  if isinstance(exn, TooManyPreparationsError):
    return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exn))
  return None


def _unary(method):
  """Refusals become their status; anything else INTERNAL with its cause.

  Each call is isolated: a bad request never disturbs other jobs.
  """
  @functools.wraps(method)
  def wrapper(self, request, context=None):
    try:
      return method(self, request, context)
    except Exception as exn:  # pylint: disable=broad-except
      _abort(method.__name__, exn, context)
  return wrapper


def _abort(name: str, exn: Exception, context) -> None:
  """Ends a call that raised: a refusal with its code, anything else as
  INTERNAL (not left to gRPC: its UNKNOWN status would carry str(exn)
  uncut); either text bounded. Without a context (a direct call), raises."""
  refusal = _refusal(exn)
  if context is None:
    raise refusal or exn
  if refusal is not None:
    context.abort(refusal.code, bounded(refusal.message))
  _LOGGER.exception('%s failed', name)
  context.abort(grpc.StatusCode.INTERNAL,
                bounded(f'{name} failed: {type(exn).__name__}: {exn}'))


def _streaming(method):
  @functools.wraps(method)
  def wrapper(self, request, context=None):
    try:
      yield from method(self, request, context)
    except Exception as exn:  # pylint: disable=broad-except
      _abort(method.__name__, exn, context)
  return wrapper


def _timestamp(ts: float) -> timestamp_pb2.Timestamp:
  out = timestamp_pb2.Timestamp()
  out.FromNanoseconds(int(ts * 1e9))
  return out


def _state_event(event: StateEvent) -> beam_job_api_pb2.JobStateEvent:
  return beam_job_api_pb2.JobStateEvent(
      state=event.state, timestamp=_timestamp(event.timestamp))


def peer_host(context) -> str:
  """The host of the client calling, as gRPC names the peer
  ('ipv4:10.0.0.5:41234', 'ipv6:[::1]:41234', URL-quoted in newer gRPC):
  its address without the port; '' with no context (in-process)."""
  if context is None:
    return ''
  peer = urllib.parse.unquote(context.peer() or '')
  kind, _, address = peer.partition(':')
  if kind in ('ipv4', 'ipv6'):
    host = address.rpartition(':')[0] if ':' in address else address
    return host.strip('[]')
  return kind or peer  # 'unix', 'unknown': one client each


def _active(context):
  return (lambda: True) if context is None else context.is_active


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


class JobService(beam_job_api_pb2_grpc.JobServiceServicer):
  def __init__(
      self,
      invoke: Invoke,
      staging=None,
      staging_endpoint: str = '',
      store: Optional[JobStore] = None,
      max_invocation_history: int = DEFAULT_MAX_INVOCATION_HISTORY,
      spark_master: str = '',
      recovery: Optional[StreamingRecovery] = None,
      environment_overrides: Sequence[EnvironmentOverride] = (),
      max_preparations: int = DEFAULT_MAX_PREPARATIONS,
      preparation_timeout_secs: float = DEFAULT_PREPARATION_TIMEOUT_SECS,
      url_policy: Optional[UrlPolicy] = None,
      max_preparations_per_client: Optional[int] = None):
    self._staging = staging
    # URL artifacts: none fetched unless allowed (urls.py).
    self._url_policy = url_policy or UrlPolicy()
    self._environment_overrides = list(environment_overrides)
    self._staging_endpoint = staging_endpoint
    self._spark_master = spark_master
    self.registry = JobRegistry(
        invoke, store=store, max_invocation_history=max_invocation_history,
        on_evict=staging.remove_job if staging is not None else None,
        recovery=recovery, max_preparations=max_preparations,
        max_preparations_per_client=max_preparations_per_client,
        preparation_timeout_secs=preparation_timeout_secs)

  def resume_interrupted(self) -> list[str]:
    """Runs again, from their checkpoints, the streaming jobs an earlier
    run of the server left unfinished (JobRegistry.resumable), with the
    artifacts they staged then; returns their ids. Call once serving."""
    resumed = self.registry.resumable()
    for job_id in resumed:
      self.registry.resume(job_id, resolve=self._resumed_pipeline)
    return resumed

  def _resumed_pipeline(self, job_id: str) -> beam_runner_api_pb2.Pipeline:
    """A resumed job's pipeline with its staged artifacts (kept under
    --artifacts-dir while the job is in the history); raises what staging
    raises when they are gone."""
    pipeline = self.registry.pipeline(job_id)
    if self._staging is None or not any(dependencies(pipeline).values()):
      return pipeline
    return _with_resolved_artifacts(pipeline, self._staging.resolved_artifacts(
        self.registry.job(job_id).staging_token))

  # -- Job API ----------------------------------------------------------------

  @_unary
  def Prepare(self, request, context=None):
    options = job_utils.struct_to_dict(request.pipeline_options)
    # Beam's Python client always sends job_name='job'; the user's
    # --job_name travels in the options.
    job_name = options_module.job_name(options) or request.job_name or 'job'
    pipeline = beam_runner_api_pb2.Pipeline()
    pipeline.CopyFrom(request.pipeline)
    try:
      overridden = apply_overrides(
          pipeline,
          parse_overrides(RunnerOptions.job_overrides(options)) +
          self._environment_overrides)
    except ValueError as exn:
      raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exn)) from exn
    try:
      check_supported(pipeline)
    except UnsupportedPipelineError as exn:
      raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exn)) from exn
    self._check_urls(pipeline)
    try:
      plan_pipeline(pipeline)  # a malformed pipeline fails here
    except Exception as exn:  # pylint: disable=broad-except
      raise Refusal(
          grpc.StatusCode.INVALID_ARGUMENT,
          f'The pipeline of job {job_name!r} is malformed: '
          f'{type(exn).__name__}: {exn}') from exn
    size = request.pipeline_options.ByteSize()
    if size > MAX_OPTIONS_BYTES:
      raise Refusal(
          grpc.StatusCode.INVALID_ARGUMENT,
          f'The pipeline options of job {job_name[:80]!r} take {size} bytes; '
          f'at most {MAX_OPTIONS_BYTES} are accepted.')
    try:
      job = self.registry.prepare(job_name, pipeline, options,
                                  client=peer_host(context))
    except ValueError as exn:
      raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exn)) from exn
    for note in overridden + ignored_by_job_server(options,
                                                   self._spark_master):
      self.registry.note(job.job_id, note)
    if self._staging is not None:
      self._staging.register_job(job.staging_token, dependencies(pipeline))
    return beam_job_api_pb2.PrepareJobResponse(
        preparation_id=job.job_id,
        artifact_staging_endpoint=endpoints_pb2.ApiServiceDescriptor(
            url=self._staging_endpoint),
        staging_session_token=job.staging_token)

  def _check_urls(self, pipeline: beam_runner_api_pb2.Pipeline) -> None:
    """Refuses, all at once, the URL artifacts this server may not fetch:
    it would fetch them itself, from its own network (urls.py)."""
    refused = []
    for key, artifacts in dependencies(pipeline).items():
      env_id = key.split(':', 1)[1]
      for artifact in artifacts:
        try:
          url = artifact_url(artifact)
          if url is not None:
            self._url_policy.check(
                url, f'The URL artifact of environment {env_id!r}')
        except UrlNotAllowedError as exn:
          refused.append(str(exn))
    if refused:
      raise Refusal(grpc.StatusCode.PERMISSION_DENIED, '\n'.join(refused))

  @_unary
  def Run(self, request, context=None):
    job = self.registry.job(request.preparation_id)
    if job.has_run:
      raise Refusal(
          grpc.StatusCode.FAILED_PRECONDITION,
          f'Job {job.job_id!r} was already run.')
    pipeline = self.registry.pipeline(job.job_id)
    if self._staging is not None and any(dependencies(pipeline).values()):
      if not self._staging.is_staged(job.staging_token):
        raise Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f'Artifact staging for {job.job_id!r} has not finished: stage '
            'the artifacts with the staging token from Prepare, then Run.')
      pipeline = _with_resolved_artifacts(
          pipeline, self._staging.resolved_artifacts(job.staging_token))
    try:
      self.registry.run(job.job_id, pipeline)
    except ValueError as exn:  # an option we cannot honour, or unsupported
      if isinstance(exn, UnsupportedPipelineError):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exn)) from exn
      raise Refusal(
          grpc.StatusCode.INVALID_ARGUMENT,
          f'Invalid pipeline option for job {job.job_id!r}: {exn}') from exn
    return beam_job_api_pb2.RunJobResponse(job_id=job.job_id)

  @_unary
  def GetState(self, request, context=None):
    return _state_event(self.registry.state(request.job_id))

  def _refuse_unrun(self, job_id: str) -> None:
    """Refuses a stream on a preparation not run yet.

    Beam's Python PortableRunner opens its state and message streams on
    the preparation id with ``timeout=job_server_timeout`` (300 s by
    default) and, only if the server refuses that id, opens them on Run's
    job id with no deadline (portable_runner.py, ``JobServiceHandle.run``).
    Beam's Java InMemoryJobService refuses it (a preparation is not an
    invocation there). A server that accepted it would bind the whole job
    to the client's deadline: DEADLINE_EXCEEDED after 300 s. Once run, the
    same id (ours are one) serves its streams from the job's start.
    """
    job = self.registry.job(job_id)
    if not job.has_run and job.state == beam_job_api_pb2.JobState.STOPPED:
      raise Refusal(
          grpc.StatusCode.NOT_FOUND,
          f'Job {job_id!r} is prepared but not running: its state and '
          'message streams open once Run has started it (GetState answers '
          'before).')

  @_streaming
  def GetStateStream(self, request, context=None):
    self._refuse_unrun(request.job_id)
    for event in self.registry.subscribe(
        request.job_id, messages=False, active=_active(context)):
      yield _state_event(event)

  @_streaming
  def GetMessageStream(self, request, context=None):
    self._refuse_unrun(request.job_id)
    events = self.registry.subscribe(
        request.job_id, messages=True, active=_active(context))
    for number, event in enumerate(events, 1):
      if isinstance(event, MessageEvent):
        yield beam_job_api_pb2.JobMessagesResponse(
            message_response=beam_job_api_pb2.JobMessage(
                message_id=f'{request.job_id}-{number}',
                time=str(int(event.timestamp * 1000)),
                importance=event.importance,
                message_text=bounded(event.text, MAX_MESSAGE_TEXT_BYTES)))
      else:
        yield beam_job_api_pb2.JobMessagesResponse(
            state_response=_state_event(event))

  @_unary
  def Cancel(self, request, context=None):
    return beam_job_api_pb2.CancelJobResponse(
        state=self.registry.cancel(request.job_id))

  @_unary
  def Drain(self, request, context=None):
    """A running streaming job drains: its reads stop at what they hold,
    its windows fire, it ends DRAINED. Batch jobs: FAILED_PRECONDITION."""
    return beam_job_api_pb2.DrainJobResponse(
        state=self.registry.drain(request.job_id))

  @_unary
  def GetJobs(self, request, context=None):
    """Every job; their options (secret-looking values redacted, as on the
    status page) only while the answer stays well under gRPC's default
    4 MB message limit (newest jobs first get theirs)."""
    infos, budget = [], GET_JOBS_OPTIONS_BYTES
    for job in reversed(self.registry.jobs()):
      info = beam_job_api_pb2.JobInfo(
          job_id=job.job_id, job_name=job.job_name, state=job.state)
      options = job_utils.dict_to_struct(redact_options(job.options))
      if options.ByteSize() <= budget:
        info.pipeline_options.CopyFrom(options)
        budget -= options.ByteSize()
      infos.append(info)
    return beam_job_api_pb2.GetJobsResponse(job_info=list(reversed(infos)))

  @_unary
  def GetPipeline(self, request, context=None):
    return beam_job_api_pb2.GetJobPipelineResponse(
        pipeline=self.registry.pipeline(request.job_id))

  @_unary
  def GetJobMetrics(self, request, context=None):
    committed, attempted = self.registry.metrics(request.job_id)
    return beam_job_api_pb2.GetJobMetricsResponse(
        metrics=beam_job_api_pb2.MetricResults(
            attempted=attempted, committed=committed))

  @_unary
  def DescribePipelineOptions(self, request, context=None):
    return beam_job_api_pb2.DescribePipelineOptionsResponse(options=[
        beam_job_api_pb2.PipelineOptionDescriptor(
            name=info.name,
            type=_OPTION_TYPES[info.kind],
            description=info.description,
            default_value='' if info.default is None else str(info.default),
            group='PySparkRunner') for info in runner_options()
    ])


def _with_resolved_artifacts(pipeline, resolved):
  """The pipeline with each environment's dependencies as staged files,
  an AnyOf environment's members' too: a member's dependencies left as
  the client gave them were paths the driver would open on its own disk."""
  pipeline = beam_runner_api_pb2.Pipeline.FromString(
      pipeline.SerializeToString())
  for env_id, env in pipeline.components.environments.items():
    if env.urn == common_urns.environments.ANYOF.urn:
      payload = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
          env.payload)
      for i, member in enumerate(payload.environments):
        _replace_dependencies(member, resolved.get(f'{i}:{env_id}'))
      env.payload = payload.SerializeToString()
    else:
      _replace_dependencies(env, resolved.get(f'0:{env_id}'))
  return pipeline


def _replace_dependencies(env, deps) -> None:
  if deps is not None:
    del env.dependencies[:]
    env.dependencies.extend(deps)
