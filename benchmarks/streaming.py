"""A windowed count over an unbounded source at a steady offered rate:
ours against Beam's own streaming DirectRunner.

    python -m benchmarks.streaming [--rates 100,1000,5000] [--seconds 40]
        [--warmup 15] [--variants ours,direct] [--master local[2]]

The pipeline: ``PeriodicImpulse`` offers ``rate`` events a second for
``seconds`` (event time = the time it is due, so event time is wall-clock
time), keyed over 10 keys, counted per key in 1-second fixed windows, and
a sink that notes, for every pane, its window's end and the wall-clock
time it reached the sink. Each (variant, rate) runs in a fresh process;
the order of the variants alternates between rates.

Printed per run, over the windows that end after ``warmup`` seconds (the
start-up of Spark or of the DirectRunner is not latency):

* records/s: the events counted in those windows over their time span,
  and whether the run kept up with the offered rate (every event of those
  windows counted, latency not growing from the first third of the
  windows to the last, and at most 5 s at the median);
* event-to-output latency, p50 and p99: the pane's arrival at the sink
  minus its window's end, which is the earliest any runner could emit it;
* ours only: the micro-batch floor, the shortest micro-batch the run had
  (the runner's ``micro_batch_millis`` distribution: min and mean).

And the ratio of the latencies, ours / DirectRunner, at each rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_CHILD = r'''
import json, os, sys, time
import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse

variant, rate, seconds, out, master = sys.argv[1:6]
rate, seconds = float(rate), float(seconds)


class Note(beam.DoFn):
  def __init__(self, path):
    self.path = path

  def process(self, kv, w=beam.DoFn.WindowParam):
    line = '%f %f %d\n' % (float(w.end), time.time(), kv[1])
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
      os.write(fd, line.encode())
    finally:
      os.close(fd)


flags = ['--streaming']
if variant == 'ours':
  flags += ['--runner=beam_pyspark.PySparkRunner',
            '--spark_master_url=' + master]
else:
  flags += ['--runner=DirectRunner']
start = time.time()
p = beam.Pipeline(options=PipelineOptions(flags))
_ = (p
     | PeriodicImpulse(start_timestamp=start, stop_timestamp=start + seconds,
                       fire_interval=1.0 / rate)
     | beam.Map(lambda t: (int(float(t) * 1000) % 10, 1))
     | beam.WindowInto(window.FixedWindows(1))
     | beam.CombinePerKey(sum)
     | beam.ParDo(Note(out)))
result = p.run()
result.wait_until_finish()
stats = {'start': start}
if variant == 'ours':
  found = result.metrics().query(MetricsFilter().with_name(
      'micro_batch_millis'))['distributions']
  if found:
    d = found[0].committed
    stats.update(batches=d.count, batch_min_ms=d.min, batch_mean_ms=d.mean)
print('STATS ' + json.dumps(stats))
'''


def run_once(variant: str, rate: float, seconds: float, master: str) -> dict:
  with tempfile.TemporaryDirectory(prefix='beam-pyspark-stream-') as tmp:
    out = os.path.join(tmp, 'panes')
    done = subprocess.run(
        [sys.executable, '-c', _CHILD, variant, str(rate), str(seconds), out,
         master],
        capture_output=True, text=True, check=False,
        timeout=seconds * 10 + 600)
    if done.returncode != 0:
      raise RuntimeError(
          f'{variant} at {rate}/s failed:\n{done.stderr[-3000:]}')
    stats = {}
    for line in done.stdout.splitlines():
      if line.startswith('STATS '):
        stats = json.loads(line[6:])
    panes = []
    if os.path.exists(out):
      with open(out, encoding='utf-8') as f:
        panes = [tuple(float(x) for x in line.split()) for line in f]
  stats['panes'] = panes
  return stats


# Beyond this median latency a run is behind its offered rate.
LAGGING_SECS = 5.0


def summarize(stats: dict, rate: float, seconds: float, warmup: float) -> dict:
  start = stats['start']
  panes = [(end, at, n) for end, at, n in stats['panes']
           if end > start + warmup and end <= start + seconds]
  if not panes:
    return {'error': 'no window ended after the warm-up'}
  latencies = sorted(at - end for end, at, _ in panes)
  ends = sorted({end for end, _, _ in panes})
  counted = sum(n for _, _, n in panes)
  span = ends[-1] - ends[0] + 1
  offered = rate * span
  by_window = {}
  for end, at, _ in panes:
    by_window.setdefault(end, []).append(at - end)
  per_window = [max(by_window[e]) for e in ends]
  third = max(1, len(per_window) // 3)
  growing = (statistics.median(per_window[-third:]) >
             statistics.median(per_window[:third]) + 1.0)
  summary = {
      'records_per_sec': counted / span,
      'offered_per_sec': rate,
      # A run whose panes wait over LAGGING_SECS at the median fell behind
      # (at start-up, say) even if it did not fall further behind.
      'kept_up': (counted >= 0.99 * offered and not growing and
                  _quantile(latencies, 0.50) <= LAGGING_SECS),
      'latency_p50': _quantile(latencies, 0.50),
      'latency_p99': _quantile(latencies, 0.99),
      'windows': len(ends),
  }
  for key in ('batches', 'batch_min_ms', 'batch_mean_ms'):
    if key in stats:
      summary[key] = stats[key]
  return summary


def _quantile(values: list[float], q: float) -> float:
  return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rates', default='100,1000,5000')
  parser.add_argument('--seconds', type=float, default=40)
  parser.add_argument('--warmup', type=float, default=15)
  parser.add_argument('--variants', default='ours,direct')
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--json', help='Also write the results here.')
  args = parser.parse_args(argv)
  rates = [float(r) for r in args.rates.split(',')]
  variants = args.variants.split(',')
  results = []
  for i, rate in enumerate(rates):
    order = variants if i % 2 == 0 else list(reversed(variants))
    row = {'rate': rate}
    for variant in order:
      started = time.monotonic()
      stats = run_once(variant, rate, args.seconds, args.master)
      row[variant] = summarize(stats, rate, args.seconds, args.warmup)
      row[variant]['process_secs'] = time.monotonic() - started
      print(f'{variant:>6} at {rate:>7.0f}/s: '
            + json.dumps(row[variant], sort_keys=True), flush=True)
    results.append(row)
  print()
  print('| offered/s | variant | records/s | kept up | latency p50 (s) | '
        'latency p99 (s) | micro-batch min / mean (s) |')
  print('|---|---|---|---|---|---|---|')
  for row in results:
    for variant in variants:
      r = row[variant]
      if 'error' in r:
        print(f'| {row["rate"]:.0f} | {variant} | {r["error"]} |||||')
        continue
      floor = (f'{r["batch_min_ms"] / 1000:.2f} / '
               f'{r["batch_mean_ms"] / 1000:.2f}'
               if 'batch_min_ms' in r else '-')
      print(f'| {row["rate"]:.0f} | {variant} | {r["records_per_sec"]:.0f} '
            f'| {"yes" if r["kept_up"] else "no"} | '
            f'{r["latency_p50"]:.2f} | {r["latency_p99"]:.2f} | {floor} |')
  if 'ours' in variants and 'direct' in variants:
    print()
    for row in results:
      ours, direct = row['ours'], row['direct']
      if 'error' in ours or 'error' in direct:
        continue
      print(f'at {row["rate"]:.0f}/s: latency p50 ours / DirectRunner '
            f'{ours["latency_p50"] / direct["latency_p50"]:.2f}x, p99 '
            f'{ours["latency_p99"] / direct["latency_p99"]:.2f}x')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
