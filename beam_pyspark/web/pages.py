"""The status page's HTML: the job list and a job's page, from plain data.

Input is what web.jobdata makes (the /api JSON); every string that came
from a job (names, ids, options, messages, metric names) is escaped here.
A job's page is built of sections (``job_sections``) that its script
swaps in while the job runs, so the first view and the live one are the
same HTML.
"""

from __future__ import annotations

import html
import json
import urllib.parse
from typing import Callable
from typing import Optional

from beam_pyspark.web import assets
from beam_pyspark.web import charts
from beam_pyspark.web.jobdata import SEVERITIES

_esc = html.escape


def job_path(job_id: str) -> str:
  """The job's page; ids may hold '/', so it is quoted as one segment."""
  return '/jobs/' + urllib.parse.quote(job_id, safe='')


def page(title: str, body: str, script: str = '') -> bytes:
  tail = f'<script>{script}</script>' if script else ''
  return (f'<!doctype html><html><head><meta charset="utf-8">'
          f'<title>{_esc(title)}</title>'
          f'<style>{assets.STYLE}{charts.STYLE}</style>'
          f'</head><body>{body}{tail}</body></html>').encode('utf-8')


def progress_bar(progress: Optional[dict]) -> str:
  if not progress:
    return ''
  percent = 100 * progress['fraction']
  return (f'<span class="bar"><span class="fill" style="width:{percent:.1f}%">'
          f'</span></span><span class="tasks">{progress["done"]}/'
          f'{progress["total"]} tasks</span>')


def _duration(row: dict) -> str:
  seconds = row['duration_secs']
  return '' if seconds is None else f'{seconds:.1f} s'


def jobs_page(rows: list[dict]) -> bytes:
  lines = []
  for row in rows:
    p = row['progress']
    data = (f' data-done="{p["done"]}" data-total="{p["total"]}"'
            if p else '')
    lines.append(
        f'<tr data-job-id="{_esc(row["job_id"])}">'
        f'<td><a href="{_esc(job_path(row["job_id"]))}">'
        f'{_esc(row["job_name"])}</a></td>'
        f'<td><code>{_esc(row["job_id"])}</code></td>'
        f'<td class="state state-{row["state"]}">{row["state"]}</td>'
        f'<td class="progress"{data}>{progress_bar(p)}</td>'
        f'<td>{row["submitted_at"]}</td>'
        f'<td class="num">{_duration(row)}</td></tr>')
  table = ('<table id="jobs"><thead><tr><th>Name</th><th>Id</th>'
           '<th>State</th><th>Progress (Spark tasks)</th><th>Submitted</th>'
           '<th class="num">Duration</th></tr></thead>'
           f'<tbody id="jobs-body">{"".join(lines)}</tbody></table>')
  empty = '' if rows else '<p class="muted">No jobs yet.</p>'
  return page('beam-pyspark jobs', f'<h1>Jobs</h1>{table}{empty}',
              assets.JOBS_SCRIPT)


def _table(headers: list[str], rows: list[list[str]], cls: str = '') -> str:
  """Cells are HTML already (escaped by the caller)."""
  if not rows:
    return '<p class="muted">None.</p>'
  head = ''.join(f'<th>{h}</th>' for h in headers)
  body = ''.join('<tr>' + ''.join(f'<td>{c}</td>' for c in row) + '</tr>'
                 for row in rows)
  return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def _value(value) -> str:
  if isinstance(value, float):
    return _esc(f'{value:,.6g}')
  if isinstance(value, int):
    return _esc(f'{value:,}')
  if value is None:
    return ''
  if isinstance(value, (dict, list)):
    return f'<code>{_esc(json.dumps(value, default=str))}</code>'
  return _esc(str(value))


def _metrics_section(metrics: dict) -> str:
  parts = []
  counters = [[_esc(m['namespace']), _esc(m['name']), _esc(m['step']),
               _value(m['committed']), _value(m['attempted'])]
              for m in metrics['counters']]
  parts.append('<h3>Counters</h3>' + _table(
      ['Namespace', 'Name', 'Step', 'Committed', 'Attempted'], counters))
  dists = []
  for m in metrics['distributions']:
    c, a = m['committed'] or {}, m['attempted'] or {}
    dists.append([_esc(m['namespace']), _esc(m['name']), _esc(m['step'])] + [
        _value(c.get(k)) for k in ('count', 'sum', 'min', 'max', 'mean')] + [
            _value(a.get('count')), _value(a.get('sum'))])
  parts.append('<h3>Distributions</h3>' + _table(
      ['Namespace', 'Name', 'Step', 'Count', 'Sum', 'Min', 'Max', 'Mean',
       'Attempted count', 'Attempted sum'], dists))
  gauges = [[_esc(m['namespace']), _esc(m['name']), _esc(m['step']),
             _value(m['committed']), _value(m['attempted'])]
            for m in metrics['gauges']]
  parts.append('<h3>Gauges</h3>' + _table(
      ['Namespace', 'Name', 'Step', 'Committed', 'Attempted'], gauges))
  return ''.join(parts)


# A streaming job runs Spark stages for each micro-batch: its table shows
# the last ones only (progress keeps spark.progress.MAX_STAGES_SHOWN).
STREAMING_STAGES_SHOWN = 12


def spark_master(master: Optional[dict]) -> str:
  """'local[*] (4 cores)': the master the job asked for, and what Spark
  made of it (spark.session.master_info)."""
  if not master:
    return ''
  text = _esc(master['master'])
  if master.get('cores'):
    text += f' ({master["cores"]:,} cores)'
  return text


def _stages_section(detail: dict) -> str:
  stages = detail['spark_stages']
  note = ''
  if detail['streaming'] and len(stages) > STREAMING_STAGES_SHOWN:
    note = (f'<p class="muted">The last {STREAMING_STAGES_SHOWN} Spark '
            f'stages (a streaming job runs some for each micro-batch; '
            f'{detail.get("spark_jobs_count") or 0:,} Spark jobs so far).'
            '</p>')
    stages = stages[-STREAMING_STAGES_SHOWN:]
  rows = []
  for s in stages:
    name = _esc(s['name'])
    if s.get('url'):
      name = f'<a href="{_esc(s["url"])}">{name}</a>'
    rows.append([str(s['stage_id']), name] + [
        f'{s[k]:,}' for k in ('done', 'active', 'failed', 'total')])
  ui = detail['spark_ui']
  master = spark_master(detail.get('spark_master'))
  spark = []
  if master:
    spark.append(f'Spark master: <span id="spark-master">{master}</span>')
  if ui:
    spark.append(f'Spark UI: <a href="{_esc(ui)}">{_esc(ui)}</a>')
  link = f'<p class="spark">{" &middot; ".join(spark)}</p>' if spark else ''
  return link + note + _table(
      ['Spark stage', 'Name', 'Tasks done', 'Active', 'Failed', 'Total'], rows)


def _messages_section(detail: dict) -> str:
  lines = ''.join(
      f'<li class="message sev-{m["severity"]}"><span class="sev '
      f'sev-{m["severity"]}">{m["severity"]}</span> {m["at"]} '
      f'<pre>{_esc(m["text"])}</pre></li>' for m in detail['messages'])
  return f'<ul class="messages">{lines}</ul>' if lines else (
      '<p class="muted">No messages.</p>')


def _streaming_section(status: Optional[dict]) -> str:
  """A streaming engine's status (engine.OPTIONAL_METHODS): one table per
  key, whatever it holds, as plain data."""
  if not status:
    return ''
  parts = ['<h2>Streaming</h2>']
  if status.get('series'):
    parts.append(charts.streaming_charts(status['series']))
  for key, value in status.items():
    if key == 'series':
      continue  # charted above
    parts.append(f'<h3>{_esc(str(key).replace("_", " ").capitalize())}</h3>')
    if isinstance(value, dict) and value and all(
        isinstance(v, dict) for v in value.values()):
      columns = sorted({c for v in value.values() for c in v})
      parts.append(_table(['', *map(_esc, columns)], [
          [_esc(str(k))] + [_value(v.get(c)) for c in columns]
          for k, v in value.items()]))
    elif isinstance(value, dict):
      parts.append(_table(['', 'Value'], [
          [_esc(str(k)), _value(v)] for k, v in value.items()]))
    elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
      columns = list(dict.fromkeys(c for v in value for c in v))
      parts.append(_table(list(map(_esc, columns)), [
          [_value(v.get(c)) for c in columns] for v in value]))
    else:
      parts.append(f'<p>{_value(value)}</p>')
  return ''.join(parts)


def job_sections(detail: dict, graph: Callable[[], str]) -> dict[str, str]:
  """The parts of a job's page that change while it runs, by element id.

  ``graph()``: the stage graph's SVG (drawn with the detail's counts)."""
  return {
      'job-state': (f'<span class="state state-{detail["state"]}">'
                    f'{detail["state"]}</span> '
                    f'<span class="progress">'
                    f'{progress_bar(detail["progress"])}</span> '
                    f'<span class="muted">{_duration(detail)}</span>'
                    + (f'<span class="failure" id="job-failure">'
                       f'{_esc(detail["failure"])}</span>'
                       if detail.get('failure') else '')),
      'job-graph': graph(),
      'job-stages': _stages_section(detail) + (
          '' if detail['streaming'] else
          charts.progress_chart(detail.get('progress_history') or [])),
      'job-metrics': _metrics_section(detail['metrics']),
      'job-messages': _messages_section(detail),
      'job-streaming': _streaming_section(detail['streaming']),
  }


def _filters(job_id: str, current: str) -> str:
  links = []
  for name, label in [('', 'All')] + [(s, f'{s.capitalize()} and above')
                                       for s in SEVERITIES[1:]]:
    href = job_path(job_id) + (f'?importance={name}' if name else '')
    cls = ' class="current"' if name == current else ''
    links.append(f'<a href="{_esc(href)}"{cls}>{_esc(label)}</a>')
  return f'<p class="filters">Show: {"".join(links)}</p>'


def job_page(detail: dict, sections: dict[str, str], importance: str,
             cancel_enabled: bool) -> bytes:
  job_id = detail['job_id']
  path = job_path(job_id)
  cancel = ''
  if cancel_enabled and not detail['terminal']:
    cancel = (f'<form class="cancel" method="post" '
              f'action="{_esc(path)}/cancel"><button type="submit" '
              'id="cancel">Cancel</button></form>')
    if detail.get('streaming'):
      cancel += (f'<form class="cancel" method="post" '
                 f'action="{_esc(path)}/drain"><button type="submit" '
                 'id="drain" title="Reads stop at what they hold, every '
                 'window fires, then the job ends DRAINED">Drain</button>'
                 '</form>')
  states = ''.join(f'<li>{s["at"]} {s.get("label") or s["state"]}</li>'
                   for s in detail['states'])
  chosen = detail.get('options_set', detail['options'])
  options = (_table(['Option', 'Value'], [
      [_esc(k), _value(v)] for k, v in chosen.items()], 'options-set')
             if chosen else '<p class="muted">Only Beam\'s defaults.</p>')
  options += (f'<details id="all-options"><summary>All '
              f'{len(detail["options"])} options, Beam\'s defaults '
              f'included</summary>' + _table(['Option', 'Value'], [
                  [_esc(k), _value(v)] for k, v in detail['options'].items()])
              + '</details>')
  artifacts = _table(['Environment', 'Name', 'Location', 'Type'], [
      [_esc(a['environment']), _esc(a['name']), _esc(a['location']),
       _esc(a['type'])] for a in detail['artifacts']])
  body = (
      f'<div id="job" data-live="{_esc(path)}/live" '
      f'data-terminal="{"true" if detail["terminal"] else "false"}">'
      f'<p><a href="/">All jobs</a> &middot; '
      f'<a href="/api{_esc(path)}">JSON</a></p>'
      f'<h1>{_esc(detail["job_name"])}</h1>'
      f'<p><code>{_esc(job_id)}</code></p>'
      f'<p><span id="job-state">{sections["job-state"]}</span>{cancel}</p>'
      f'<h2>Stages</h2><p class="muted">Fused stages and the Beam transforms '
      'each holds; edges carry Beam\'s element counts.</p>'
      f'<div id="job-graph">{sections["job-graph"]}</div>'
      f'<h2>Spark stages</h2><div id="job-stages">{sections["job-stages"]}'
      '</div>'
      f'<h2>Metrics</h2><div id="job-metrics">{sections["job-metrics"]}'
      '</div>'
      f'<div id="job-streaming">{sections["job-streaming"]}</div>'
      f'<h2>Messages</h2>{_filters(job_id, importance)}'
      f'<div id="job-messages">{sections["job-messages"]}</div>'
      f'<h2>States</h2><ul>{states}</ul>'
      f'<h2>Options you set</h2>{options}'
      f'<h2>Staged artifacts</h2>{artifacts}</div>')
  return page(f'{detail["job_name"]} - beam-pyspark', body, assets.JOB_SCRIPT)
