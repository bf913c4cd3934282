"""What the status page shows of a job, as plain data (its /api JSON).

Everything comes from the job registry (the same data as the Job API):
the job's snapshot, its metrics (committed and attempted MonitoringInfos),
its messages, its pipeline, and the progress its engine reports as plain
dicts. No Spark here; the HTML pages (web.pages) render these dicts.
"""

from __future__ import annotations

import time
from typing import Iterable
from typing import Optional

from apache_beam.metrics import monitoring_infos as mi
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import root_cause
from beam_pyspark.events import Importance
from beam_pyspark.events import JobState
from beam_pyspark.events import state_name
from beam_pyspark.redaction import redact
from beam_pyspark.redaction import redact_urls

# Messages a job's page and its JSON carry: its last ones.
MAX_MESSAGES_SHOWN = 500
# Severity names for the messages' filter, least severe first.
SEVERITIES = ('DEBUG', 'DETAILED', 'BASIC', 'WARNING', 'ERROR')


def severity(importance: int) -> str:
  return Importance.Name(importance).replace('JOB_MESSAGE_', '')


def importance_of(name: Optional[str]) -> int:
  """A severity name (any case) as a message importance; unknown: all."""
  name = (name or '').upper()
  if name in SEVERITIES:
    return Importance.Value('JOB_MESSAGE_' + name)
  return Importance.JOB_MESSAGE_DEBUG


def when(ts: float) -> str:
  return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))


def duration(job) -> Optional[float]:
  """Seconds since RUNNING (to the end once it ended); None before."""
  started = next((e.timestamp for e in job.states
                  if e.state == JobState.RUNNING), None)
  if started is None:
    return None
  ended = job.states[-1].timestamp if job.states[-1].terminal else time.time()
  return max(0.0, ended - started)


def task_progress(job, progress: Optional[dict]) -> Optional[dict]:
  """Spark tasks done/total over the job's Spark jobs, or None if its
  engine reported none. A job that ended DONE reads as complete: Spark's
  status tracker hears of its last tasks' ends asynchronously."""
  if not progress:
    return None
  done, total = progress.get('tasks_done', 0), progress.get('tasks_total', 0)
  if job.state == JobState.DONE:
    done = total = max(done, total)
  return {
      'done': done,
      'total': total,
      'active': progress.get('tasks_active', 0),
      'failed': progress.get('tasks_failed', 0),
      'fraction': round(done / total, 4) if total else 0.0,
  }


def job_row(registry, job) -> dict:
  """One line of the job list."""
  seconds = duration(job)
  return {
      'job_id': job.job_id,
      'job_name': job.job_name,
      'state': state_name(job.state),
      'terminal': job.states[-1].terminal if job.states else False,
      'submitted': job.created,
      'submitted_at': when(job.created),
      'duration_secs': None if seconds is None else round(seconds, 3),
      'progress': task_progress(job, registry.progress(job.job_id)),
  }


def element_counts(infos: Iterable) -> dict[str, int]:
  """PCollection id -> elements (Beam's element_count monitoring info)."""
  counts: dict[str, int] = {}
  for info in infos:
    if info.urn == mi.ELEMENT_COUNT_URN:
      pcoll = info.labels.get(mi.PCOLLECTION_LABEL, '')
      counts[pcoll] = counts.get(pcoll, 0) + int(
          mi.extract_counter_value(info))
  return counts


def _user_values(infos: Iterable) -> dict[tuple, tuple[str, object]]:
  values = {}
  for info in infos:
    if not mi.is_user_monitoring_info(info):
      continue
    try:
      value = mi.extract_metric_result_map_value(info)
    except Exception:  # pylint: disable=broad-except
      continue  # a kind the page does not show
    if value is None:
      continue
    labels = info.labels
    key = (labels.get(mi.NAMESPACE_LABEL, ''), labels.get(mi.NAME_LABEL, ''),
           labels.get(mi.PTRANSFORM_LABEL, ''))
    if mi.is_counter(info):
      values[key] = ('counters', value)
    elif mi.is_distribution(info):
      values[key] = ('distributions', {
          'sum': value.sum, 'count': value.count, 'min': value.min,
          'max': value.max,
          'mean': round(value.sum / value.count, 6) if value.count else None})
    elif mi.is_gauge(info):
      values[key] = ('gauges', value.value)
  return values


def user_metrics(committed: Iterable, attempted: Iterable) -> dict:
  """The user's counters, distributions and gauges, committed and
  attempted side by side, sorted by namespace, name and step."""
  committed_values = _user_values(committed)
  attempted_values = _user_values(attempted)
  result: dict[str, list] = {'counters': [], 'distributions': [], 'gauges': []}
  for key in sorted(set(committed_values) | set(attempted_values)):
    kind = (committed_values.get(key) or attempted_values[key])[0]
    namespace, name, step = key
    result[kind].append({
        'namespace': namespace, 'name': name, 'step': step,
        'committed': committed_values.get(key, (None, None))[1],
        'attempted': attempted_values.get(key, (None, None))[1]})
  return result


def artifacts(pipeline: beam_runner_api_pb2.Pipeline) -> list[dict]:
  """The job's staged artifacts, per environment: what and where."""
  rows = []
  for env_id, env in sorted(pipeline.components.environments.items()):
    for dep in env.dependencies:
      name = ''
      if dep.role_urn == common_urns.artifact_roles.STAGING_TO.urn:
        name = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(
            dep.role_payload).staged_name
      where = ''
      if dep.type_urn == common_urns.artifact_types.FILE.urn:
        where = beam_runner_api_pb2.ArtifactFilePayload.FromString(
            dep.type_payload).path
      elif dep.type_urn == common_urns.artifact_types.URL.urn:
        where = beam_runner_api_pb2.ArtifactUrlPayload.FromString(
            dep.type_payload).url
      where = redact_urls(where)  # a presigned URL's signature, say
      rows.append({'environment': env_id, 'name': name or where,
                   'type': dep.type_urn, 'location': where})
  return rows


def messages(registry, job_id: str, min_importance: int) -> list[dict]:
  shown = [m for m in registry.messages(job_id)
           if m.importance >= min_importance][-MAX_MESSAGES_SHOWN:]
  return [{'time': m.timestamp, 'at': when(m.timestamp),
           'severity': severity(m.importance), 'text': m.text}
          for m in shown]


def _plain(key: str) -> str:
  if key.startswith('beam:option:') and key.endswith(':v1'):
    return key[len('beam:option:'):-len(':v1')]
  return key


def options(job) -> dict:
  """The job's pipeline options by their plain names, secret-looking
  values redacted (beam_pyspark.redaction)."""
  return {_plain(k): redact(_plain(k), v)
          for k, v in sorted(job.options.items())}


# (the option classes it was computed from, Beam's default of each option)
_defaults: Optional[tuple] = None
# What Beam's clients add to every portable pipeline's experiments.
_ADDED_EXPERIMENTS = ('beam_fn_api',)


def _option_classes(cls) -> frozenset:
  found = set()
  todo = [cls]
  while todo:
    for sub in todo.pop().__subclasses__():
      if sub not in found:
        found.add(sub)
        todo.append(sub)
  return frozenset(found)


def beam_defaults() -> dict:
  """Beam's default value of each pipeline option Python knows (this
  runner's among them): Beam's clients send every option, defaults
  included (80 of them for a plain pipeline). Computed again when a
  PipelineOptions class was defined since: Beam's client sends the
  options of every class its process imported, and an option class
  defined after the first page (a test module's, a user's in-process
  pipeline's) made its defaults read as set (CI, stop 45)."""
  global _defaults  # pylint: disable=global-statement
  from apache_beam.options.pipeline_options import PipelineOptions  # pylint: disable=import-outside-toplevel
  import beam_pyspark.options  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  classes = _option_classes(PipelineOptions)
  if _defaults is None or _defaults[0] != classes:
    _defaults = (classes, dict(PipelineOptions([]).get_all_options(
        retain_unknown_options=True)))
  return _defaults[1]


def set_options(job) -> dict:
  """The options the user set, redacted as ``options``: those whose value
  is not Beam's default (an option Python's Beam does not know, a Java
  SDK's say, counts as set). A user who set an option to its default value
  is not told apart from one who did not: the Job API carries values, not
  flags."""
  defaults = beam_defaults()
  shown = {}
  for key, value in sorted(job.options.items()):
    name = _plain(key)
    if name == 'experiments' and isinstance(value, list):
      value = [e for e in value if e not in _ADDED_EXPERIMENTS] or None
    if value is None:  # no choice (Beam's client sends an unset value
      continue         # provider as null)
    if name not in defaults or not _same(defaults[name], value):
      shown[name] = redact(name, value)
  return shown


def _same(default, value) -> bool:
  # A value-provider option's default is a RuntimeValueProvider holding
  # it: Beam's client sends the default's value (its encode_pipeline_options
  # reads a provider's value where it has one).
  default = getattr(default, 'default_value', default)
  # The Job API carries numbers as doubles (a Struct): 1 arrives as 1.0.
  if default is None:
    return value is None or value is False or value in ('', [], {})
  return default == value or str(default) == str(value)


def states(job) -> list[dict]:
  """The job's states, the first as Beam has it. Beam's Job API reads a
  prepared job as STOPPED ("not started yet"): the page calls that entry
  'PREPARED', so that a job's first state never reads as if it had been
  stopped."""
  shown = []
  for i, e in enumerate(job.states):
    name = state_name(e.state)
    label = name
    if i == 0 and e.state == JobState.STOPPED:
      label = 'PREPARED'
    shown.append({'state': name, 'label': label, 'time': e.timestamp,
                  'at': when(e.timestamp)})
  return shown


def failure(registry, job) -> Optional[str]:
  """A failed job's root cause in one line (errors.root_cause of its
  error message); None unless it failed."""
  if job.state != JobState.FAILED:
    return None
  errors = [m for m in registry.messages(job.job_id)
            if m.importance >= Importance.JOB_MESSAGE_ERROR]
  if not errors:
    return 'The job failed (its messages say no more).'
  return root_cause(errors[-1].text)


def job_detail(registry, job_id: str, min_importance: int) -> dict:
  """Everything a job's page shows (raises KeyError for an unknown id)."""
  job = registry.job(job_id)
  committed, attempted = registry.metrics(job_id)
  progress = registry.progress(job_id) or {}
  detail = job_row(registry, job)
  detail.update({
      'states': states(job),
      'failure': failure(registry, job),
      'spark_ui': progress.get('spark_ui'),
      'spark_master': progress.get('master'),
      'spark_stages': list(progress.get('stages', [])),
      'spark_jobs_count': progress.get('spark_jobs_count'),
      'progress_history': list(progress.get('history', [])),
      'beam_stage_tasks_done': dict(progress.get('beam_stages', {})),
      'metrics': user_metrics(committed, attempted),
      'element_counts': element_counts(committed),
      'messages': messages(registry, job_id, min_importance),
      'options': options(job),
      'options_set': set_options(job),
      'artifacts': artifacts(registry.pipeline(job_id)),
      'streaming': registry.streaming_status(job_id),
  })
  return detail
