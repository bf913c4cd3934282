"""Per-process cache of a job's pipeline components, coders and windowing."""

from __future__ import annotations

import collections
import logging
import threading

from apache_beam.coders import coders
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners import pipeline_context
from apache_beam.transforms import core
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Duration

from beam_pyspark.planning.sdks import normalized_trigger
from beam_pyspark.planning.sdks import python_knows_window_fn
from beam_pyspark.worker.shuffle import paging

_MAX_JOBS = 8
_lock = threading.Lock()
_runtimes: 'collections.OrderedDict[str, JobRuntime]' = collections.OrderedDict()


class JobRuntime:
  """Decoded components of one job, built once per Python worker."""
  def __init__(self, job_id: str, components: bytes):
    self.job_id = job_id
    self.components = beam_runner_api_pb2.Components.FromString(components)
    for ws in self.components.windowing_strategies.values():
      ws.trigger.CopyFrom(normalized_trigger(ws.trigger))
    # A state-backed iterable (a large group's values) decodes with its
    # tail read from this worker's pages (worker.shuffle.paging), as the
    # fast path reads a GroupByKey's output.
    self.context = pipeline_context.PipelineContext(
        self.components, iterable_state_read=paging.read_paged_values)
    self._impls: dict[str, object] = {}
    self._windowings: dict[str, object] = {}

  def coder(self, coder_id: str):
    return self.context.coders[coder_id]

  def coder_impl(self, coder_id: str):
    impl = self._impls.get(coder_id)
    if impl is None:
      impl = self._impls[coder_id] = self.context.coders[coder_id].get_impl()
    return impl

  def windowing(self, windowing_strategy_id: str,
                opaque_windows: bool = False):
    """The strategy's Windowing; a stand-in WindowFn where the runner sees
    the windows as opaque (``opaque_windows``), does not know the WindowFn
    (another SDK's), or must not merge again (already merged)."""
    key = (windowing_strategy_id, opaque_windows)
    w = self._windowings.get(key)
    if w is None:
      proto = self.components.windowing_strategies[windowing_strategy_id]
      if (not opaque_windows and python_knows_window_fn(proto.window_fn.urn)
          and proto.merge_status !=
          beam_runner_api_pb2.MergeStatus.ALREADY_MERGED):
        w = self.context.windowing_strategies[windowing_strategy_id]
      else:
        w = opaque_windowing(proto, self.context)
      self._windowings[key] = w
    return w


class OpaqueWindowFn(window.NonMergingWindowFn):
  """Another SDK's non-merging WindowFn, as the runner sees it.

  The runner never assigns windows (the SDK did, upstream); grouping only
  compares windows, which the runner-safe coder decodes as their max
  timestamp and their encoded bytes (Beam's timestamp-prefixed custom
  window), and asks for their end.
  """
  def __init__(self, urn: str):
    self.urn = urn

  def assign(self, assign_context):
    raise NotImplementedError(
        f'The runner cannot assign windows of {self.urn}; the SDK does.')

  def get_window_coder(self):
    return coders.TimestampPrefixingOpaqueWindowCoder()

  def __eq__(self, other):
    return type(self) is type(other) and self.urn == other.urn

  def __hash__(self):
    return hash((type(self), self.urn))


def opaque_windowing(proto, context) -> core.Windowing:
  """The windowing of a strategy whose WindowFn only its SDK knows, or
  whose windows are already merged (Java's GroupByKey marks its output so
  after merging windows: grouping it again must not merge them again)."""
  if proto.merge_status not in (beam_runner_api_pb2.MergeStatus.NON_MERGING,
                                beam_runner_api_pb2.MergeStatus.ALREADY_MERGED):
    raise ValueError(
        f'The WindowFn {proto.window_fn.urn} merges windows, which only its '
        'SDK can do; the runner runs merging WindowFns that Python knows '
        '(sessions among them).')
  from apache_beam.transforms.trigger import TriggerFn  # pylint: disable=import-outside-toplevel
  return core.Windowing(
      windowfn=OpaqueWindowFn(proto.window_fn.urn),
      triggerfn=TriggerFn.from_runner_api(proto.trigger, context),
      accumulation_mode=proto.accumulation_mode,
      timestamp_combiner=proto.output_time,
      allowed_lateness=Duration(micros=proto.allowed_lateness * 1000))


def job_runtime(job_id: str, components: bytes) -> JobRuntime:
  with _lock:
    runtime = _runtimes.get(job_id)
    if runtime is None:
      runtime = _runtimes[job_id] = JobRuntime(job_id, components)
      while len(_runtimes) > _MAX_JOBS:
        _runtimes.popitem(last=False)
    else:
      _runtimes.move_to_end(job_id)
    return runtime


def forget_job(job_id: str) -> None:
  with _lock:
    _runtimes.pop(job_id, None)


_options_in_use: object = None


def use_job_options(options: dict | None) -> None:
  """What Beam's SDK worker does with its job's options when it starts
  (``sdk_worker_main``), done in this Python worker for the job whose task
  runs here: a templated pipeline's ``RuntimeValueProvider`` options read
  their values, ``FileSystems`` gets the job's options (``hdfs_host``, S3
  and GCS settings) and the pickler the job's ``pickle_library``. A Python
  worker runs one task at a time; it does this again only when the job's
  options differ from the last task's."""
  global _options_in_use
  options = options or {}
  if options == _options_in_use:
    return
  root = logging.getLogger()
  quiet = None if root.handlers else logging.NullHandler()
  if quiet is not None:
    # Importing Beam's file systems logs through the root logger ('apitools
    # not found'), which would give this worker's root logger Python's
    # default console handler: every later log of its tasks printed on
    # the console besides the job's messages.
    root.addHandler(quiet)
  try:
    from apache_beam.internal import pickler
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.options.pipeline_options import SetupOptions
    from apache_beam.options.value_provider import RuntimeValueProvider
  finally:
    if quiet is not None:
      root.removeHandler(quiet)
  plain = {_option_name(key): value for key, value in options.items()}
  RuntimeValueProvider.set_runtime_options(plain)
  pipeline_options = PipelineOptions.from_dictionary(plain)
  FileSystems.set_options(pipeline_options)
  pickler.set_library(pipeline_options.view_as(SetupOptions).pickle_library)
  _options_in_use = dict(options)


def _option_name(key: str) -> str:
  """A Job API option's name as PipelineOptions knows it:
  ``beam:option:NAME:v1`` -> ``NAME``."""
  if key.startswith('beam:option:') and key.endswith(':v1'):
    return key[len('beam:option:'):-len(':v1')]
  return key
