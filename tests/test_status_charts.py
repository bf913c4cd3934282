"""A running streaming job's charts, in a real browser, against its metrics.

A real job server runs a streaming job sent by Beam's PortableRunner: a
PeriodicImpulse offering 400 events a second while each micro-batch may
read only 20 (``--max_records_per_batch``), so the job falls behind on
purpose. Its page, in headless Chromium (as test_status_live), must chart
rates, micro-batch durations, watermark lags and backlog with points whose
values are the job's own metrics, and show the read's watermark lag
growing. Set BEAM_PYSPARK_SCREENSHOTS=DIR to write the picture
docs/guide/status-page.md shows (docs/status-streaming.png) there.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import urllib.parse

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse

from status_jobs import portable_options
from test_status_live import _get_json
from test_status_live import _wait
from test_status_live import browser  # noqa: F401  (a fixture)
from test_status_live import linux_only
from test_status_live import screenshot_on_failure
from test_status_live import server  # noqa: F401  (a fixture)

CHARTS = ('records_per_sec', 'batch_secs', 'read_lag', 'stage_lag', 'backlog')


def _behind_pipeline(endpoint: str) -> beam.Pipeline:
  options = portable_options(endpoint, 'charts-behind', 2).get_all_options(
      drop_default=True)
  flags = [f'--{k}={v}' for k, v in options.items() if v not in (None, True)]
  flags += [f'--{k}' for k, v in options.items() if v is True]
  p = beam.Pipeline(options=PipelineOptions(
      flags + ['--streaming', '--max_records_per_batch=20']))
  start = time.time()
  _ = (p | PeriodicImpulse(start_timestamp=start, stop_timestamp=start + 600,
                           fire_interval=1 / 400)
       | 'Word' >> beam.Map(lambda t: 'w%d' % (int(float(t) * 400) % 5))
       | beam.WindowInto(window.FixedWindows(2))
       | beam.combiners.Count.PerElement())
  return p


def _charts(driver) -> dict:
  """{(chart, view): {series: [(batch, value), ...]}} as drawn."""
  found = driver.execute_script('''
      const out = [];
      for (const svg of document.querySelectorAll('svg.chart')) {
        for (const g of svg.querySelectorAll('g.series')) {
          out.push([svg.dataset.chart, svg.dataset.view, g.dataset.series,
                    Array.from(g.querySelectorAll('circle')).map(
                        c => [Number(c.dataset.batch),
                              Number(c.dataset.value)])]);
        }
      }
      return out;''')
  charts: dict = {}
  for chart, view, series, points in found:
    charts.setdefault((chart, view), {})[series] = points
  return charts


def _gauge(detail: dict, name: str, transform: str = 'streaming'):
  for g in detail['metrics']['gauges']:
    if (g['namespace'] == 'beam_pyspark.streaming' and g['name'] == name
        and g['step'] == transform):
      return g['committed']
  return None


def _distribution(detail: dict, name: str):
  for d in detail['metrics']['distributions']:
    if d['namespace'] == 'beam_pyspark.streaming' and d['name'] == name:
      return d['committed']
  return None


@linux_only
def test_a_streaming_jobs_charts_match_its_metrics_and_show_it_falling_behind(
    server, browser, tmp_path):  # noqa: F811  (fixtures)
  with screenshot_on_failure(browser, tmp_path, 'charts'):
    result = _behind_pipeline(server.job_endpoint).run()
    try:
      job_id = _wait(lambda: next((r['job_id'] for r in _get_json(
          server.status_url + 'api/jobs') if r['job_name'] == 'charts-behind'),
                                  None), 120, 'the job on the status page')
      api = (server.status_url + 'api/jobs/' +
             urllib.parse.quote(job_id, safe=''))
      browser.get(server.status_url + 'jobs/' +
                  urllib.parse.quote(job_id, safe=''))
      # Enough micro-batches to see a trend (the page refreshes itself).
      def enough():
        c = _charts(browser)
        lags = c.get(('read_lag', 'recent'), {})
        return c if max(map(len, lags.values()), default=0) >= 12 else None
      charts = _wait(enough, 240, '12 micro-batches on the charts',
                     every=1.0)
      detail = _get_json(api)

      for name in CHARTS:
        for view in ('recent', 'since_start'):
          assert (name, view) in charts, (name, view, sorted(charts))
      # Rates: the chart's points are the gauge's values, batch by batch;
      # the gauge (committed with the last micro-batch) is one of the
      # chart's last points (the page may lag the API by a refresh).
      rates = charts[('records_per_sec', 'recent')]
      read_points = dict(rates['read'])
      series = detail['streaming']['series']['recent']
      last_batches = [p['batch'] for p in series][-4:]
      gauge = _gauge(detail, 'records_read_per_sec')
      assert gauge is not None, detail['metrics']['gauges']
      assert gauge in {int(p['read_per_sec']) for p in series[-3:]}, (
          gauge, series[-3:])
      for batch, value in read_points.items():
        api_point = next((p for p in series if p['batch'] == batch), None)
        if api_point is not None:
          assert value == pytest.approx(api_point['read_per_sec']), batch
      assert max(read_points.values()) > 0, read_points
      # The budget caps each micro-batch at 20 records read.
      for p in series[1:]:
        assert p['read'] - series[series.index(p) - 1]['read'] <= 20, series
      # Durations: every committed micro-batch is in the distribution.
      durations = _distribution(detail, 'micro_batch_millis')
      assert durations['count'] >= max(last_batches) + 1 - 2, (
          durations, last_batches)
      drawn = dict(charts[('batch_secs', 'recent')]['duration'])
      for p in series:
        if p['batch'] in drawn:
          assert drawn[p['batch']] == pytest.approx(p['secs'])
      # Backlog: the chart's total is the gauge, within a micro-batch.
      backlog = _gauge(detail, 'backlog')
      assert backlog in {int(p['backlog']) for p in series[-3:]}, (
          backlog, series[-3:])

      # Falling behind: the read's watermark lag grows on the chart.
      (read, lags), = [(k, v) for k, v in
                       charts[('read_lag', 'recent')].items()]
      values = [v for _, v in sorted(lags)]
      assert values[-1] - values[0] > 1.0, (read, values)
      rising = sum(b > a for a, b in zip(values, values[1:]))
      assert rising >= 0.75 * (len(values) - 1), values

      # Axes with round ticks, legends with the full names on hover.
      ticks = browser.execute_script('''
          return [...document.querySelectorAll('svg.chart')].map(
              svg => svg.querySelectorAll('.y-tick').length);''')
      assert ticks and min(ticks) >= 3, ticks
      assert browser.execute_script('''
          return [...document.querySelectorAll('svg.chart .legend')].every(
              t => t.querySelector('title'));''')
      # Spark's stages named after Beam's, numbered as the graph numbers
      # them, and a bounded table of them.
      detail = _get_json(api)
      names = [s['name'] for s in detail['spark_stages']]
      assert names and all(n.startswith('Beam ') for n in names), names
      graph = browser.find_element('css selector', '#job-graph').text
      drawn = {int(n) for n in re.findall(r'Stage (\d+)', graph)}
      named = {int(n) for n in re.findall(r'Beam stage (\d+)', ' '.join(names))}
      assert named and named <= drawn, (named, drawn)
      rows = browser.execute_script(
          'return document.querySelectorAll("#job-stages tr").length;')
      assert rows <= 13, rows  # the last 12 and the head

      shot = tmp_path / 'status-streaming.png'
      charts_el = browser.find_element('css selector', '#job-streaming')
      browser.execute_script('arguments[0].scrollIntoView();', charts_el)
      browser.save_screenshot(str(shot))
      wanted = os.environ.get('BEAM_PYSPARK_SCREENSHOTS')
      if wanted:
        shutil.copy(shot, os.path.join(wanted, 'status-streaming.png'))
    finally:
      result.cancel()


# -- the charts' axes and legends, drawn from plain points (no job) ----------


def _drawn(svg: str, cls: str) -> list[float]:
  return [float(v) for v in re.findall(
      rf'class="tick {cls}"[^>]*data-value="([^"]+)"', svg)]


def test_a_charts_axes_have_round_ticks_with_units():
  from beam_pyspark.web import charts
  points = [{'time': 1000.0 + t, 'batch': i, 'v': 3.3 * t}
            for i, t in enumerate(range(0, 95, 5))]
  svg = charts.chart('c', 'Lag', 's', points, {'v': lambda p: p['v']},
                     'recent')
  y_ticks = _drawn(svg, 'y-tick')
  assert y_ticks == [0, 100, 200, 300], y_ticks  # the max is 297
  assert _drawn(svg, 'x-tick') == [0, -20, -40, -60, -80]
  assert 'Lag (s)' in svg and 'seconds before the last micro-batch' in svg
  assert charts.ticks(0, 0.0123) == [0, 0.0025, 0.005, 0.0075, 0.01, 0.0125]
  assert charts.ticks(-3, 7) == [-4, -2, 0, 2, 4, 6, 8]


def test_legends_tell_lines_with_a_long_common_prefix_apart():
  from beam_pyspark.web import charts
  names = ['ReadFromKafka/KafkaIO.Read/Remove Kafka Metadata/Map',
           'ReadFromKafka/KafkaIO.Read/Remove Kafka Metadata/Filter']
  points = [{'time': float(t), 'batch': t, 'lag': {n: t for n in names}}
            for t in range(3)]
  svg = charts.chart('read_lag', 'Lag', 's', points,
                     charts._keyed_lines(points, 'lag'), 'recent')
  legends = re.findall(r'class="legend"[^>]*><title>([^<]*)</title>([^<]*)<',
                       svg)
  assert sorted(full for full, _ in legends) == sorted(names)
  labels = [label for _, label in legends]
  assert len(set(labels)) == 2 and all(len(l) <= 28 for l in labels), labels
  assert charts.legend_labels(['a' * 40 + 'x', 'a' * 40 + 'x']) == [
      '1: ' + charts._short('a' * 40 + 'x', 25),
      '2: ' + charts._short('a' * 40 + 'x', 25)]
