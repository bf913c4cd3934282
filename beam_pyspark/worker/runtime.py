"""Per-process cache of a job's pipeline components, coders and windowing."""

from __future__ import annotations

import collections
import threading

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners import pipeline_context

_MAX_JOBS = 8
_lock = threading.Lock()
_runtimes: 'collections.OrderedDict[str, JobRuntime]' = collections.OrderedDict()


class JobRuntime:
  """Decoded components of one job, built once per Python worker."""
  def __init__(self, job_id: str, components: bytes):
    self.job_id = job_id
    self.components = beam_runner_api_pb2.Components.FromString(components)
    self.context = pipeline_context.PipelineContext(self.components)
    self._impls: dict[str, object] = {}
    self._windowings: dict[str, object] = {}

  def coder(self, coder_id: str):
    return self.context.coders[coder_id]

  def coder_impl(self, coder_id: str):
    impl = self._impls.get(coder_id)
    if impl is None:
      impl = self._impls[coder_id] = self.context.coders[coder_id].get_impl()
    return impl

  def windowing(self, windowing_strategy_id: str):
    w = self._windowings.get(windowing_strategy_id)
    if w is None:
      w = self._windowings[windowing_strategy_id] = (
          self.context.windowing_strategies[windowing_strategy_id])
    return w


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
