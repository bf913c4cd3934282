"""``--runner=beam_pyspark.PySparkRunner``: run a Beam pipeline on Spark."""

from __future__ import annotations

import logging
import sys
import threading
import uuid
from typing import Optional

from apache_beam.options import pipeline_options
from apache_beam.options.value_provider import RuntimeValueProvider
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners import runner
from apache_beam.runners.portability.fn_api_runner.fn_runner import (
    group_by_key_input_visitor)
from apache_beam.transforms import environments

from beam_pyspark import console
from beam_pyspark.engine import over_connect
from beam_pyspark.errors import InvalidOptionsError
from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.errors import user_exception
from beam_pyspark.events import TERMINAL_STATES
from beam_pyspark.events import MessageEvent
from beam_pyspark.execution import PipelineExecution
from beam_pyspark.jobservice.jobs import JobRegistry
from beam_pyspark.messages import PYTHON_LEVELS
from beam_pyspark.metrics import PipelineMetrics
from beam_pyspark import options as options_module
from beam_pyspark.options import RunnerOptions
from beam_pyspark.options import misspelled_options
from beam_pyspark.options import unknown_option_names
from beam_pyspark.planning.environments import apply_overrides
from beam_pyspark.planning.environments import parse_all as parse_overrides
from beam_pyspark.sdk_dependencies import StagedDependencies
from beam_pyspark.spark.session import console_progress_bar
from beam_pyspark.spark.session import spark_context
from beam_pyspark.planning.names import user_transform_names

_LOGGER = logging.getLogger(__name__)

_STATES = {
    beam_job_api_pb2.JobState.STOPPED: runner.PipelineState.STOPPED,
    beam_job_api_pb2.JobState.STARTING: runner.PipelineState.STARTING,
    beam_job_api_pb2.JobState.RUNNING: runner.PipelineState.RUNNING,
    beam_job_api_pb2.JobState.DONE: runner.PipelineState.DONE,
    beam_job_api_pb2.JobState.FAILED: runner.PipelineState.FAILED,
    beam_job_api_pb2.JobState.CANCELLED: runner.PipelineState.CANCELLED,
    beam_job_api_pb2.JobState.CANCELLING: runner.PipelineState.CANCELLING,
    beam_job_api_pb2.JobState.DRAINING: runner.PipelineState.DRAINING,
    beam_job_api_pb2.JobState.DRAINED: runner.PipelineState.DRAINED,
}
_ENDED = frozenset(_STATES[s] for s in TERMINAL_STATES if s in _STATES)


class PySparkRunner(runner.PipelineRunner):
  """Runs pipelines on Spark, with Beam's Python harness inside executors."""
  def run_pipeline(self, pipeline, options):
    RuntimeValueProvider.set_runtime_options({})
    # Before anything is built or started: Beam drops an option it does not
    # know with a warning, and a misspelled master would run the job on
    # the default one.
    problems = misspelled_options(unknown_option_names(options))
    if problems:
      raise InvalidOptionsError(problems)
    debug = options.view_as(pipeline_options.DebugOptions)
    experiments = debug.experiments or []
    if 'beam_fn_api' not in experiments:
      experiments.append('beam_fn_api')
    debug.experiments = experiments
    # Like the FnApiRunner: GroupByKey inputs must be KVs with deterministic
    # key coders.
    pipeline.visit(
        group_by_key_input_visitor(
            not options.view_as(pipeline_options.TypeOptions).
            allow_non_deterministic_key_coders))
    proto = pipeline.to_runner_api(
        default_environment=self._environment(options))
    # --requirements_file, --extra_package, --setup_file, --save_main_session
    # as Beam's PortableRunner stages them; the engine ships them.
    staged = StagedDependencies(options)
    try:
      result = self.run_portable_pipeline(staged.add_to(proto), options)
    except BaseException:
      staged.remove()
      raise
    staged.remove_after(result._execution)
    return result

  def _environment(self, options) -> environments.Environment:
    """The embedded harness unless --environment_type asks for another.

    LOOPBACK serves a worker pool in this process, as Beam's PortableRunner
    does: the DoFns run here, in the client, where a debugger can see them.
    """
    portable = options.view_as(pipeline_options.PortableOptions)
    kind = portable.environment_type
    if not kind or kind == python_urns.EMBEDDED_PYTHON:
      return environments.EmbeddedPythonEnvironment.default()
    if kind == 'LOOPBACK':
      from apache_beam.runners.worker import sdk_worker_main
      from apache_beam.runners.worker import worker_pool_main
      # Start Spark (it forks its JVM launcher) before the worker pool's
      # gRPC server runs: a fork under running gRPC threads can fail.
      runner_options = RunnerOptions.from_pipeline_options(options)
      if not over_connect(runner_options):  # (a Connect client forks none)
        spark_context(runner_options.master, runner_options.conf)
      address, server = (
          worker_pool_main.BeamFnExternalWorkerPoolServicer.start(
              # The user-state cache, sized by the job's options as
              # Beam's PortableRunner sizes it (the runner gives each
              # task's state its own cache token).
              state_cache_size=sdk_worker_main._get_state_cache_size_bytes(  # pylint: disable=protected-access
                  options),
              use_process=False))
      self._loopback_servers = getattr(self, '_loopback_servers', [])
      self._loopback_servers.append(server)
      return environments.ExternalEnvironment(address)
    return environments.Environment.from_options(portable)

  def run_portable_pipeline(self, pipeline, options):
    runner_options = RunnerOptions.from_pipeline_options(options)
    # Decided before the job's thread starts: that thread imports pyspark,
    # and a second import of it from this thread at the same time finds it
    # half initialized (an ImportError of pyspark.serializers).
    progress_mode = _progress_mode(runner_options)
    registry = job_registry()
    status_url = None
    if runner_options.status_port is not None:
      status_url = status_page(runner_options.status_port)
    job_name = (options_module.job_name(runner_options.job_options) or
                options_module.program_job_name(sys.argv[0]))
    # Docker environments (an expansion service's, say) run as the
    # overrides say: executors have no Docker daemon.
    pipeline = beam_runner_api_pb2.Pipeline.FromString(
        pipeline.SerializeToString())
    overridden = apply_overrides(
        pipeline, parse_overrides(runner_options.environment_overrides))
    # Short ids, as before the registry: 'job-' and 12 hex digits.
    job = registry.prepare(
        job_name or 'job', pipeline, runner_options.job_options,
        job_id=f'{job_name or "job"}-{uuid.uuid4().hex[:12]}')
    for note in overridden:
      registry.note(job.job_id, note)
    client_log = _ClientLog()
    executions = []

    def invoke(job_id, job_pipeline, _job_options, listener):
      def both(event):
        listener(event)
        client_log(event)
      execution = PipelineExecution(job_pipeline, runner_options, job_id,
                                    both, status_url=lambda: status_url)
      client_log.execution = execution
      executions.append(execution)
      return execution

    # Raises UnsupportedPipelineError before anything runs.
    registry.run(job.job_id, invoke=invoke)
    return PySparkPipelineResult(
        registry, job.job_id, executions[0],
        _progress_reporter(progress_mode, registry, executions[0]))


_REGISTRY: Optional[JobRegistry] = None
_REGISTRY_LOCK = threading.Lock()
# Jobs of this process that its registry (and so a status page) keeps.
RUNNER_HISTORY = 100


_STATUS = None


def status_page(port: int = 0) -> str:
  """This process's status page over its job registry, started on first
  use on localhost:``port`` (0: a free port); its URL. Later calls return
  the running page's URL, whatever their port."""
  global _STATUS
  with _REGISTRY_LOCK:
    status = _STATUS
  if status is None:
    from beam_pyspark.web.server import StatusPages  # pylint: disable=import-outside-toplevel
    from beam_pyspark.web.server import StatusServer  # pylint: disable=import-outside-toplevel
    pages = StatusPages(job_registry())
    with _REGISTRY_LOCK:
      if _STATUS is None:
        _STATUS = StatusServer(pages, 'localhost', port).start()
        _LOGGER.info('Status page of this program\'s jobs: %s', _STATUS.url)
      status = _STATUS
  return status.url


def _progress_mode(options: RunnerOptions) -> str:
  """--progress, with auto resolved: one rewritten line only on a terminal
  that Spark's own console progress bar does not write to as well."""
  mode = options.progress
  if mode != console.AUTO:
    return mode
  try:
    tty = sys.stderr.isatty()
  except (AttributeError, ValueError):  # replaced or closed stderr
    tty = False
  # Spark's own console bar (a context the user started with it; ours
  # turn it off) would fight over the line. Spark makes that bar when its
  # context starts: it cannot be turned off for one job.
  return console.AUTO if tty and (
      over_connect(options) or not console_progress_bar(options.conf)) else (
          console.LOG)


def _progress_reporter(mode: str, registry: JobRegistry,
                       execution: PipelineExecution
                       ) -> Optional[console.ProgressReporter]:
  if mode == console.OFF:
    return None
  job_id = execution.job_id

  def stages():
    plan = execution.plan
    return [] if plan is None else [
        (s.name, user_transform_names(s.transform_names)) for s in plan.stages]

  def wait_ended(timeout):
    state = registry.wait(job_id, timeout)
    # A job stopped to resume (Ctrl-C) is over for this program too: its
    # reporter ends rather than hold the program's exit for its join.
    return state if state in TERMINAL_STATES or (
        state == beam_job_api_pb2.JobState.STOPPED) else None

  return console.ProgressReporter(
      mode, job_id, stages, execution.progress,
      lambda: execution.committed_metrics, wait_ended, sys.stderr, _LOGGER,
      links=execution.links).start()


def job_registry() -> JobRegistry:
  """This process's jobs: the one owner of their state, as the job
  server's registry is of its jobs'."""
  global _REGISTRY
  with _REGISTRY_LOCK:
    if _REGISTRY is None:
      _REGISTRY = JobRegistry(
          invoke=_no_default_invoke, max_invocation_history=RUNNER_HISTORY)
    return _REGISTRY


def _no_default_invoke(job_id, *_):
  raise RuntimeError(f'Job {job_id} was prepared without an executor.')


class _ClientLog:
  """The job's messages (executors' logs among them) in the client's log.

  The job's failure is not repeated here at its level: wait_until_finish
  raises it with the whole traceback, and the engine logs one line of it.
  """
  def __init__(self):
    self.execution: Optional[PipelineExecution] = None

  def __call__(self, event) -> None:
    if not isinstance(event, MessageEvent):
      return
    level = PYTHON_LEVELS.get(event.importance, logging.INFO)
    if self.execution is not None and event.text == self.execution.error:
      level = logging.DEBUG
    _LOGGER.log(level, '%s', event.text)


class PySparkPipelineResult(runner.PipelineResult):
  """A job of this process, read from its registry."""
  def __init__(self, registry: JobRegistry, job_id: str,
               execution: PipelineExecution,
               reporter: Optional[console.ProgressReporter] = None):
    super().__init__(runner.PipelineState.STARTING)
    self._registry = registry
    self._job_id = job_id
    self._execution = execution
    self._reporter = reporter

  @property
  def job_id(self) -> str:
    return self._job_id

  @property
  def state(self):
    return _STATES.get(self._registry.state(self._job_id).state,
                       runner.PipelineState.UNKNOWN)

  def wait_until_finish(self, duration: Optional[int] = None):
    # Milliseconds; None or 0 waits until the job ends, as Beam's
    # PortableRunner reads it (Beam's load tests wait with 0).
    timeout = duration / 1000.0 if duration else None
    try:
      self._registry.wait(self._job_id, timeout)
    except KeyboardInterrupt:
      self._stop_on_interrupt()
      raise
    state = self.state
    if self._reporter is not None and state in _ENDED:
      self._reporter.join()  # its summary before what the program prints
    if state == runner.PipelineState.FAILED:
      error = self._execution.error or ''
      details = f'Pipeline {self.job_id} failed:\n{error}'
      # As Beam's DirectRunner raises it: the user's exception type, with
      # the step's name, and the traceback from the executor in its text.
      user = user_exception(error, details)
      if user is None:
        raise PipelineExecutionError(details)
      raise user from None
    return state

  def _stop_on_interrupt(self) -> None:
    """Ctrl-C while waiting: a streaming job with a checkpoint location
    stops between micro-batches, its checkpoint kept, and says how to
    resume; any other job is cancelled. Either way before the program
    exits, so that Spark's stream thread is not torn down under a running
    micro-batch (Java's traces of a lost callback server)."""
    location = self._execution.options.checkpoint_location
    stopping = self._execution.interrupt(
        'Interrupted (Ctrl-C)',
        resume=f'running the same pipeline with --checkpoint_location='
        f'{location} resumes from it', graceful=True)
    if not stopping:
      self._registry.cancel(self._job_id)
    try:
      # The execution's own wait: a STOPPED job is over, not terminal.
      self._execution.wait()
    except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the batch
      self._execution.cancel()
      raise
    if self._reporter is not None:
      # Its summary on a terminal (a poll a second); the log's polls are
      # 30 s apart, and the line below says it all.
      self._reporter.join(console.TERMINAL_SECS + 0.5)
    if stopping and self.state == runner.PipelineState.STOPPED:
      print(f'Job {self.job_id} stopped, checkpoint kept at {location}: run '
            'the same pipeline with that --checkpoint_location again to '
            'resume.', file=sys.stderr, flush=True)
    else:
      print(f'Job {self.job_id} {self.state.lower()}.', file=sys.stderr,
            flush=True)

  def cancel(self):
    self._registry.cancel(self._job_id)
    self._registry.wait(self._job_id)
    if self._reporter is not None:
      self._reporter.join()
    return self.state

  def drain(self):
    """Drains a streaming job and waits for it: its reads stop at what
    they hold now, every window fires, it ends DRAINED (the Job API's
    Drain; Beam's PipelineResult has no such call, Dataflow's console
    does)."""
    self._registry.drain(self._job_id)
    self._registry.wait(self._job_id)
    if self._reporter is not None:
      self._reporter.join()
    return self.state

  def metrics(self):
    return PipelineMetrics(
        self._execution.committed_metrics, self._execution.attempted_metrics)

  def monitoring_infos(self):
    return list(self._execution.committed_metrics)
