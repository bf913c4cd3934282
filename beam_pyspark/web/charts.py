"""A streaming job's charts, drawn on the server as SVG (no script needed).

Input is the 'series' of a streaming job's status (streaming.series: one
point per micro-batch, the last ones and since the start). Each chart is
an ``<svg class="chart" data-chart=... data-view=...>``; each of its lines
a ``<g class="series" data-series=...>`` whose points are circles carrying
their micro-batch and value (``data-batch``, ``data-value``) and a title
for the pointer, so what is drawn can be read back exactly.
"""

from __future__ import annotations

import html
import math
from typing import Callable
from typing import Optional

WIDTH, HEIGHT = 440, 170
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 24, 28
COLOURS = ('#4a6fa5', '#c0504d', '#4f9a4f', '#a5804a', '#7f5fa5', '#3a9aa5',
           '#a54a7f', '#777777')
# Lines a chart draws at most (per-endpoint backlog: the largest ones).
MAX_LINES = len(COLOURS)

_esc = html.escape


def _step(span: float, ticks: int = 5) -> float:
  """A round step (1, 2, 2.5 or 5 times a power of ten) that cuts
  ``span`` into about ``ticks`` parts."""
  if span <= 0:
    return 1.0
  raw = span / ticks
  magnitude = 10 ** math.floor(math.log10(raw))
  for step in (1, 2, 2.5, 5, 10):
    if raw <= step * magnitude:
      return step * magnitude
  return 10 * magnitude


def ticks(low: float, high: float, count: int = 5) -> list[float]:
  """Round tick values from ``low`` (rounded down) up to at least
  ``high``: the axis' ends and what lies between, each labelled."""
  step = _step(high - low, count)
  first = math.floor(low / step) * step
  values = [first]
  while values[-1] < high - step * 1e-9:
    values.append(round(first + step * len(values), 10))
  return values


def _short(name: str, limit: int = 28) -> str:
  """A legend's label: long names cut in the middle, so that names
  sharing a long prefix (a pipeline's transforms) keep what tells them
  apart, their ends."""
  if len(name) <= limit:
    return name
  head = (limit - 1) // 3
  return name[:head] + '\u2026' + name[-(limit - 1 - head):]


def legend_labels(names: list[str], limit: int = 28) -> list[str]:
  """Labels that tell the lines apart: each cut in the middle, and any
  that still read the same numbered ('1: ...')."""
  labels = [_short(n, limit) for n in names]
  if len(set(labels)) < len(labels):
    labels = [f'{i + 1}: {_short(n, limit - 3)}' for i, n in enumerate(names)]
  return labels


def _fmt(value: float) -> str:
  if abs(value) >= 1000:
    return f'{value:,.0f}'
  return f'{value:.3g}'


def chart(name: str, title: str, unit: str, points: list[dict],
          lines: dict[str, Callable[[dict], Optional[float]]],
          view: str, level: Optional[float] = None,
          point: str = 'micro-batch') -> str:
  """One line chart: x is each point's wall time, y each line's value.

  ``lines``: line name -> its value in a point (None: no value there);
  ``level``: a dashed horizontal line (e.g. the trigger interval)."""
  values = {n: [(p, f(p)) for p in points] for n, f in lines.items()}
  finite = [v for vs in values.values() for _, v in vs if v is not None]
  y_ticks = ticks(min(0.0, min(finite, default=0.0)),
                  max(finite + ([level] if level else []), default=0) or 1.0)
  bottom, top = y_ticks[0], y_ticks[-1]
  t0 = points[0]['time'] if points else 0.0
  t1 = points[-1]['time'] if points else 1.0
  span = max(t1 - t0, 1e-6)
  plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

  def x(t):
    return LEFT + (t - t0) / span * plot_w if len(points) > 1 else (
        LEFT + plot_w / 2)

  def y(v):
    return TOP + plot_h - (v - bottom) / (top - bottom) * plot_h

  parts = [
      f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" '
      f'data-chart="{_esc(name)}" data-view="{_esc(view)}" '
      f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}">',
      f'<text x="{LEFT}" y="14" class="chart-title">{_esc(title)}'
      f'{" (" + _esc(unit) + ")" if unit else ""}</text>',
  ]
  # The y axis: a labelled tick and a faint grid line at each round value.
  for v in y_ticks:
    parts.append(
        f'<line class="grid" x1="{LEFT}" x2="{LEFT + plot_w}" '
        f'y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
        f'<text x="{LEFT - 4}" y="{y(v) + 3:.1f}" class="tick y-tick" '
        f'text-anchor="end" data-value="{v:g}">{_fmt(v)}</text>')
  # The x axis: seconds before the last point, at round steps.
  if len(points) > 1:
    for ago in ticks(0.0, span):
      if ago > span + 1e-9:
        break
      px = LEFT + plot_w - ago / span * plot_w
      parts.append(
          f'<line class="axis" x1="{px:.1f}" x2="{px:.1f}" '
          f'y1="{TOP + plot_h}" y2="{TOP + plot_h + 3}"/>'
          f'<text x="{px:.1f}" y="{TOP + plot_h + 13}" class="tick x-tick" '
          f'text-anchor="middle" data-value="{-ago if ago else 0:g}">'
          f'{"0" if ago == 0 else "-" + _fmt(ago)}</text>')
  parts += [
      f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" '
      f'y2="{TOP + plot_h}"/>',
      f'<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" '
      f'x2="{LEFT + plot_w}" y2="{TOP + plot_h}"/>',
      f'<text x="{LEFT + plot_w}" y="{HEIGHT - 2}" class="tick" '
      f'text-anchor="end">seconds before the last {_esc(point)}</text>',
  ]
  if level:
    parts.append(f'<line class="level" x1="{LEFT}" x2="{LEFT + plot_w}" '
                 f'y1="{y(level):.1f}" y2="{y(level):.1f}"><title>'
                 f'{_fmt(level)} {_esc(unit)}</title></line>')
  if not finite:
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h / 2}" '
                 'class="tick" text-anchor="middle">no values yet</text>')
  legend_x = LEFT + 8
  labels = legend_labels(list(values))
  for i, (line, pairs) in enumerate(values.items()):
    colour = COLOURS[i % len(COLOURS)]
    shown = [(p, v) for p, v in pairs if v is not None]
    path = ' '.join(f'{x(p["time"]):.1f},{y(v):.1f}' for p, v in shown)
    parts.append(f'<g class="series" data-series="{_esc(line)}">'
                 f'<polyline fill="none" stroke="{colour}" '
                 f'stroke-width="1.5" points="{path}"/>')
    for p, v in shown:
      parts.append(
          f'<circle cx="{x(p["time"]):.1f}" cy="{y(v):.1f}" r="2" '
          f'fill="{colour}" data-batch="{p["batch"]}" data-value="{v}">'
          f'<title>{_esc(line)}: {_fmt(v)} {_esc(unit)} ({point} '
          f'{p["batch"]})</title></circle>')
    parts.append('</g>')
    # The whole name on the pointer (an SVG <title>).
    parts.append(f'<text x="{legend_x}" y="{TOP + 12 + 12 * i}" '
                 f'class="legend" fill="{colour}" data-series="{_esc(line)}">'
                 f'<title>{_esc(line)}</title>{_esc(labels[i])}</text>')
  parts.append('</svg>')
  return ''.join(parts)


def _keyed_lines(points: list[dict], field: str) -> dict:
  """One line per key of a dict-valued field, the largest MAX_LINES."""
  peak: dict[str, float] = {}
  for p in points:
    for key, value in (p.get(field) or {}).items():
      if value is not None:
        peak[key] = max(peak.get(key, 0.0), float(value))
  keys = sorted(peak, key=lambda k: -peak[k])[:MAX_LINES]
  return {k: (lambda p, k=k: (p.get(field) or {}).get(k)) for k in sorted(keys)}


def streaming_charts(series: dict) -> str:
  """The charts of a streaming job's 'series': its last micro-batches,
  then the job since its start."""
  out = []
  for view, heading in (('recent', 'Last micro-batches'),
                        ('since_start', 'Since the job started')):
    points = series.get(view) or []
    if not points:
      continue
    interval = next((p['interval'] for p in reversed(points)
                     if p.get('interval')), None)
    charts = [
        chart('records_per_sec', 'Records per second', 'records/s', points,
              {'read': lambda p: p['read_per_sec'],
               'emitted': lambda p: p['emitted_per_sec']}, view),
        chart('batch_secs', 'Micro-batch duration', 's', points,
              {'duration': lambda p: p['secs']}, view, level=interval),
        chart('read_lag', 'Watermark lag of each read', 's', points,
              _keyed_lines(points, 'read_lag'), view),
        chart('stage_lag', 'Output watermark lag of each stage', 's', points,
              _keyed_lines(points, 'stage_lag'), view),
        chart('backlog', 'Backlog', 'records or bytes', points,
              {'total': lambda p: p['backlog'],
               **_keyed_lines(points, 'endpoint_backlog')}, view),
    ]
    out.append(f'<h3>{heading} ({len(points)} points)</h3>'
               f'<div class="charts">{"".join(charts)}</div>')
  return ''.join(out)


def progress_chart(history: list[dict]) -> str:
  """A batch job's Spark tasks done (and known) over time, from its
  progress snapshots (spark.progress); '' until there are two."""
  points = [dict(p, batch=i) for i, p in enumerate(history)]
  if len(points) < 2:
    return ''
  return chart('tasks_done', 'Spark tasks over time', 'tasks', points,
               {'done': lambda p: p['done'], 'known': lambda p: p['total']},
               'since_start', point='sample')


STYLE = ('.charts{display:flex;flex-wrap:wrap;gap:8px}'
         '.chart{border:1px solid #ddd;background:#fff}'
         '.chart .chart-title{font:bold 12px sans-serif}'
         '.chart .tick{font:10px sans-serif;fill:#555}'
         '.chart .legend{font:bold 10px sans-serif}'
         '.chart .axis{stroke:#999}'
         '.chart .grid{stroke:#eee}'
         '.chart .level{stroke:#999;stroke-dasharray:4 3}')
