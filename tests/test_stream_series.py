"""The streaming charts' points (streaming.series) and their SVG (web.charts)."""

from __future__ import annotations

import re

from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming import MIN_MICROS
from beam_pyspark.streaming.series import StreamSeries
from beam_pyspark.streaming.series import lag_secs
from beam_pyspark.web.charts import streaming_charts


def _add(series, batch, time, read, emitted, watermark=None, backlog=0.0):
  return series.add(batch=batch, time=time, secs=0.5, read=read,
                    emitted=emitted, read_watermarks={'Read': watermark},
                    stage_watermarks={'Count': watermark}, backlog=backlog,
                    endpoint_backlogs={'1': backlog})


def test_rates_are_the_change_of_the_totals_over_the_time_between():
  s = StreamSeries()
  first = _add(s, 0, 100.0, read=10, emitted=0)
  assert first['read_per_sec'] == 20.0  # over its own 0.5 s
  second = _add(s, 1, 102.0, read=30, emitted=4)
  assert (second['read_per_sec'], second['emitted_per_sec']) == (10.0, 2.0)


def test_lag_is_wall_clock_minus_the_watermark_and_none_at_the_ends():
  assert lag_secs(100.0, 97_500_000) == 2.5
  assert lag_secs(100.0, MIN_MICROS) is None
  assert lag_secs(100.0, MAX_MICROS) is None
  point = _add(StreamSeries(), 0, 100.0, 1, 0, watermark=90_000_000)
  assert point['read_lag'] == {'Read': 10.0}


def test_since_start_thins_out_evenly_and_keeps_the_newest_point():
  s = StreamSeries(recent=5, since_start=10)
  for i in range(100):
    _add(s, i, float(i), i, 0)
  snap = s.snapshot()
  assert [p['batch'] for p in snap['recent']] == [95, 96, 97, 98, 99]
  batches = [p['batch'] for p in snap['since_start']]
  assert batches[0] == 0 and batches[-1] == 99 and len(batches) <= 11
  gaps = {b - a for a, b in zip(batches[:-2], batches[1:-1])}
  assert len(gaps) == 1, batches  # evenly spaced


def test_charts_draw_every_point_with_its_value_and_skip_unknown_lags():
  s = StreamSeries()
  _add(s, 0, 100.0, 10, 0, watermark=None)  # lag unknown yet
  _add(s, 1, 101.0, 25, 5, watermark=99_000_000, backlog=7)
  svg = streaming_charts(s.snapshot())
  assert svg.count('<svg') == 10  # 5 charts x (recent, since start)
  recent = svg.split('Since the job started')[0]
  rates = re.search(r'data-chart="records_per_sec".*?</svg>', recent).group(0)
  read = re.search(r'data-series="read">(.*?)</g>', rates).group(1)
  assert re.findall(r'data-batch="(\d+)" data-value="([\d.]+)"', read) == [
      ('0', '20.0'), ('1', '15.0')]
  lag = re.search(r'data-chart="read_lag".*?</svg>', recent).group(0)
  assert re.findall(r'data-batch="(\d+)" data-value="([\d.]+)"', lag) == [
      ('1', '2.0')]


def test_a_name_from_the_pipeline_is_escaped_in_the_svg():
  s = StreamSeries()
  s.add(batch=0, time=1.0, secs=0.1, read=1, emitted=1,
        read_watermarks={'<script>x</script>': 500_000}, stage_watermarks={},
        backlog=0, endpoint_backlogs={})
  svg = streaming_charts(s.snapshot())
  assert '<script>' not in svg and '&lt;script&gt;' in svg


def test_a_batch_jobs_progress_chart_draws_tasks_done_over_time():
  from beam_pyspark.web.charts import progress_chart
  assert progress_chart([{'time': 1.0, 'done': 0, 'total': 4}]) == ''
  svg = progress_chart([{'time': 1.0, 'done': 0, 'total': 4},
                        {'time': 2.0, 'done': 3, 'total': 8}])
  done = re.search(r'data-series="done">(.*?)</g>', svg).group(1)
  assert re.findall(r'data-value="(\d+)"', done) == ['0', '3']
