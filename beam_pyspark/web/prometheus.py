"""The status page's ``/metrics``: the jobs and their Beam metrics in
Prometheus' text exposition format (version 0.0.4).

    beam_pyspark_jobs{state}                      jobs by state
    beam_pyspark_job_duration_seconds{job,...}    time since RUNNING (or to
                                                  the end)
    beam_pyspark_user_counter{job,namespace,name,transform}
    beam_pyspark_user_distribution_{sum,count,min,max}{...}
    beam_pyspark_user_gauge{...}
    beam_pyspark_elements{job,pcollection}        Beam's element counts

User metrics are the committed values, as ``result.metrics()`` gives them;
they grow while a job runs.
"""

from __future__ import annotations

from typing import Callable
from typing import Iterable
from typing import Optional

from apache_beam.metrics import monitoring_infos as mi

from beam_pyspark.events import JobState
from beam_pyspark.events import state_name

CONTENT_TYPE = 'text/plain; version=0.0.4; charset=utf-8'

_HELP = {
    'beam_pyspark_jobs': ('gauge', 'Jobs the server keeps, by state.'),
    'beam_pyspark_job_duration_seconds': (
        'gauge', 'How long the job has run (to its end once it ended).'),
    'beam_pyspark_user_counter': ('gauge', 'A Beam user counter (committed).'),
    'beam_pyspark_user_distribution_sum': (
        'gauge', 'The sum of a Beam user distribution.'),
    'beam_pyspark_user_distribution_count': (
        'gauge', 'The count of a Beam user distribution.'),
    'beam_pyspark_user_distribution_min': (
        'gauge', 'The minimum of a Beam user distribution.'),
    'beam_pyspark_user_distribution_max': (
        'gauge', 'The maximum of a Beam user distribution.'),
    'beam_pyspark_user_gauge': ('gauge', 'A Beam user gauge, its last value.'),
    'beam_pyspark_elements': (
        'gauge', 'Elements a PCollection held (Beam\'s element count).'),
}


def escape(value: str) -> str:
  """A label value, escaped as the format asks."""
  return (str(value).replace('\\', '\\\\').replace('"', '\\"')
          .replace('\n', '\\n'))


def _sample(name: str, labels: dict, value) -> str:
  text = ','.join(f'{k}="{escape(v)}"' for k, v in labels.items())
  return f'{name}{{{text}}} {float(value)!r}' if text else (
      f'{name} {float(value)!r}')


def _metric_samples(job_labels: dict, infos: Iterable) -> Iterable[tuple]:
  for info in infos:
    labels = info.labels
    try:
      value = mi.extract_metric_result_map_value(info)
    except Exception:  # pylint: disable=broad-except
      continue  # a kind this page does not show
    if info.urn == mi.ELEMENT_COUNT_URN:
      yield ('beam_pyspark_elements',
             dict(job_labels, pcollection=labels.get(mi.PCOLLECTION_LABEL, '')),
             value)
      continue
    if not mi.is_user_monitoring_info(info) or value is None:
      continue
    user = dict(job_labels,
                namespace=labels.get(mi.NAMESPACE_LABEL, ''),
                name=labels.get(mi.NAME_LABEL, ''),
                transform=labels.get(mi.PTRANSFORM_LABEL, ''))
    if mi.is_counter(info):
      yield 'beam_pyspark_user_counter', user, value
    elif mi.is_distribution(info):
      for part in ('sum', 'count', 'min', 'max'):
        yield f'beam_pyspark_user_distribution_{part}', user, getattr(
            value, part)
    elif mi.is_gauge(info):
      yield 'beam_pyspark_user_gauge', user, value.value


def exposition(jobs: list, metrics: Callable[[str], list],
               duration: Callable[[object], Optional[float]]) -> str:
  """The text for ``jobs`` (registry snapshots); ``metrics(job_id)``: its
  committed MonitoringInfos; ``duration(job)``: seconds or None."""
  samples: dict[str, list[str]] = {name: [] for name in _HELP}
  by_state = {state_name(s): 0 for s in JobState.Enum.values()
              if state_name(s) != 'UNSPECIFIED'}
  for job in jobs:
    state = state_name(job.state)
    by_state[state] = by_state.get(state, 0) + 1
    labels = {'job': job.job_id, 'job_name': job.job_name}
    seconds = duration(job)
    if seconds is not None:
      samples['beam_pyspark_job_duration_seconds'].append(
          _sample('beam_pyspark_job_duration_seconds',
                  dict(labels, state=state), seconds))
    for name, sample_labels, value in _metric_samples(
        {'job': job.job_id}, metrics(job.job_id)):
      samples[name].append(_sample(name, sample_labels, value))
  samples['beam_pyspark_jobs'] = [
      _sample('beam_pyspark_jobs', {'state': s}, n)
      for s, n in sorted(by_state.items())]
  lines = []
  for name, (kind, text) in _HELP.items():
    if samples[name]:
      lines.append(f'# HELP {name} {text}')
      lines.append(f'# TYPE {name} {kind}')
      lines.extend(samples[name])
  return '\n'.join(lines) + '\n'
