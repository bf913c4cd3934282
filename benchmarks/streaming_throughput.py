"""Streaming throughput: this runner against hand-written PySpark Structured
Streaming and PyFlink, the same windowed count at rising offered rates.

    python -m benchmarks.streaming_throughput [--rates 100000,200000,400000,800000]
        [--seconds 45] [--warmup 15]
        [--variants ours,pyspark,pyspark-pickled,pyflink]
        [--flink-python .venv-flink/bin/python] [--repeats 1]

The work, in all of them: events at a steady offered rate, a Python
function mapping each event to one of 10 keys (Beam's Map, a PySpark
``udf``, a PyFlink scalar Python UDF), 1-second fixed (tumbling) windows of
event time, a count per key and window, and a sink that notes each pane's
window end and the wall-clock time it got there. Event time is the time an
event was due, so latency = emit time minus window end (the earliest any
of them could emit it).

The peers run as their users run them, at their defaults:

* ``ours``: Beam's ``PeriodicImpulse`` -> ``Map`` -> ``WindowInto`` ->
  ``CombinePerKey(sum)`` on ``beam_pyspark.PySparkRunner --streaming``
  (local[2]); the events start ``--lead`` seconds after the job does, so
  Spark's start-up is not a backlog.
* ``pyspark``: the ``rate`` source (``rowsPerSecond``, 2 partitions) ->
  ``F.udf(lambda v: v % 10, 'int')`` -> ``groupBy(window(ts, '1 second'),
  key).count()`` with a zero-delay watermark, append mode, ``foreachBatch``
  sink, ``spark.sql.shuffle.partitions=2``, local[2], default trigger.
  PySpark's users install ``pyspark[sql]`` (pyarrow, pandas: the
  ``[bench]`` extra, in the benchmark's environment, not the runner's
  dependencies), with which Spark 4's default
  (``spark.sql.execution.pythonUDF.arrow.enabled=true``) makes the UDF
  Arrow-optimized: each run checks that its plan evaluates it with
  ``ArrowEvalPython`` and that its Python workers import pyarrow.
* ``pyspark-pickled``: the same with the Arrow optimization turned off
  (``BatchEvalPython``: rows pickled to the workers, as PySpark 3 did).
* ``pyflink``: PyPI ``apache-flink`` (``make bench-flink``; never installed
  by ``make test``: it pins its own Beam, so it lives in its own
  virtualenv, ``--flink-python``) at its defaults, in its local
  mini-cluster (parallelism: the machine's cores): the ``datagen``
  connector (``rows-per-second``, a sequence, ``ts AS LOCALTIMESTAMP``
  with ``WATERMARK FOR ts AS ts``) -> Python scalar UDF for the key -> a
  tumbling-window count -> a Python UDF noting the pane -> ``blackhole``.

Each (variant, rate) runs in a fresh process; the order of the variants
rotates between rates and repeats (the machine is shared: compare the
systems within one run, not runs across time). Over the windows after
``--warmup`` seconds of events, printed per run: records/s counted, whether
it kept up (every event counted, latency not growing from the first third
of the windows to the last, p50 under 5 s), latency p50/p99, the cores the
whole process tree used (sampled from /proc), its CPU seconds per million
events, ours' micro-batch times, and the 1-minute load average before and
after the run. Every system has a row at every rate, kept up or not.
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

import psutil

from benchmarks.streaming_jobs import OURS
from benchmarks.streaming_jobs import PYFLINK
from benchmarks.streaming_jobs import PYSPARK

# Each variant: (its child program, the arguments after the common ones).
# ``pyspark`` is PySpark as its users run it (pyspark[sql]'s pyarrow and
# pandas installed, Spark 4's default Arrow-optimized UDF);
# ``pyspark-pickled`` the same query with the UDF's Arrow optimization
# turned off, as PySpark 3 ran it.
VARIANTS = {
    'ours': (OURS, []),
    'pyspark': (PYSPARK, ['arrow']),
    'pyspark-pickled': (PYSPARK, ['pickled']),
    'pyflink': (PYFLINK, []),
}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `make bench-flink` makes it.
FLINK_PYTHON = os.path.join(REPO_ROOT, '.venv-flink', 'bin', 'python')


def _tree_cpu(proc: psutil.Process, seen: dict) -> float:
  """CPU seconds so far of ``proc`` and its descendants (``seen`` keeps the
  last reading of each, so processes that ended still count)."""
  try:
    procs = [proc] + proc.children(recursive=True)
  except psutil.Error:
    procs = []
  for p in procs:
    try:
      t = p.cpu_times()
      seen[p.pid] = t.user + t.system + t.children_user + t.children_system
    except psutil.Error:
      pass
  return sum(seen.values())


def run_once(variant: str, rate: float, seconds: float, lead: float,
             master: str, python: str, extra: list,
             observe=None) -> dict:
  """One run in a fresh process: its STATS, panes and CPU samples.
  ``observe(pid)``, if given, is called once the process started (a
  profiler attaching to it)."""
  with tempfile.TemporaryDirectory(prefix='beam-pyspark-tput-') as tmp:
    out = os.path.join(tmp, 'panes')
    program, args = VARIANTS[variant]
    # A file, not -c: its command line stays one short line (ps, py-spy).
    # Not named after a module it imports (pyspark.py would shadow it).
    script = os.path.join(tmp, f'job_{variant.replace("-", "_")}.py')
    with open(script, 'w', encoding='utf-8') as f:
      f.write(program)
    cmd = [python, script, str(rate), str(seconds), out, master,
           str(lead)] + args + (extra if variant == 'ours' else [])
    # Spark's Python workers run the child's interpreter, as they run a
    # user's activated virtualenv's python3 (else PATH's python3, which
    # may lack pyarrow).
    env = dict(os.environ, PYSPARK_PYTHON=python)
    log = open(os.path.join(tmp, 'log'), 'w+', encoding='utf-8')
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env=env)
    if observe is not None:
      observe(child.pid)
    proc, seen, cpu = psutil.Process(child.pid), {}, []
    deadline = time.time() + seconds * 10 + 600
    while child.poll() is None and time.time() < deadline:
      cpu.append((time.time(), _tree_cpu(proc, seen)))
      time.sleep(0.5)
    if child.poll() is None:
      child.kill()
    child.wait()
    log.seek(0)
    text = log.read()
    if child.returncode != 0:
      raise RuntimeError(f'{variant} at {rate}/s failed:\n{text[-3000:]}')
    stats = {}
    for line in text.splitlines():
      if line.startswith('STATS '):
        stats = json.loads(line[6:])
    expected = EVALUATED.get(variant)
    if expected and stats.get('udf_eval') != expected:
      raise RuntimeError(
          f'{variant} at {rate}/s: its key UDF ran as '
          f'{stats.get("udf_eval")} (Python workers: {stats.get("worker")}),'
          f' not {expected}: without pyarrow and pandas PySpark falls back '
          "to a pickled UDF; install the benchmark's libraries "
          "(pip install -e '.[bench]')")
    panes = []
    if os.path.exists(out):
      with open(out, encoding='utf-8') as f:
        panes = [tuple(float(x) for x in line.split()) for line in f]
  stats['panes'] = panes
  stats['cpu'] = cpu
  stats['log_tail'] = text[-3000:]
  return stats


# What a peer reports of how it ran (from inside it).
HOW = ('udf_eval', 'arrow_enabled', 'worker', 'parallelism')

# The physical plan's node that evaluates each PySpark variant's key UDF.
EVALUATED = {'pyspark': 'ArrowEvalPython',
             'pyspark-pickled': 'BatchEvalPython'}

# Beyond this median latency a run is behind its offered rate.
LAGGING_SECS = 5.0


def summarize(stats: dict, rate: float, seconds: float, warmup: float,
              variant: str) -> dict:
  panes = stats['panes']
  if not panes:
    return {'error': 'no output'}
  if variant == 'ours':  # the events' span is known
    first, last = stats['start'] + warmup, stats['start'] + seconds
  else:  # from the first pane on (the sources start with the query)
    first = stats['start'] + warmup
    last = stats['start'] + seconds - 3  # the last windows may be cut off
  every = panes
  panes = [(end, at, n) for end, at, n in panes if first < end <= last]
  if not panes:
    return {'error': 'no window ended after the warm-up'}
  latencies = sorted(at - end for end, at, _ in panes)
  ends = sorted({end for end, _, _ in panes})
  counted = sum(n for _, _, n in panes)
  span = ends[-1] - ends[0] + 1
  by_window = {}
  for end, at, _ in panes:
    by_window.setdefault(end, []).append(at - end)
  per_window = [max(by_window[e]) for e in ends]
  third = max(1, len(per_window) // 3)
  growing = (statistics.median(per_window[-third:]) >
             statistics.median(per_window[:third]) + 1.0)
  # The process tree's CPU from its first pane to its last, over the
  # events of the panes that arrived after the first: what it took to
  # count them once started, behind its rate or not.
  arrivals = sorted({at for _, at, _ in every})
  t0, t1 = arrivals[0], arrivals[-1]
  cpu = stats['cpu']
  c0 = _at(cpu, t0)
  c1 = _at(cpu, t1)
  cores = (c1 - c0) / (t1 - t0) if t1 > t0 else float('nan')
  emitted = sum(n for _, at, n in every if t0 < at <= t1)
  summary = {
      'records_per_sec': counted / span,
      'offered_per_sec': rate,
      'kept_up': (counted >= 0.99 * rate * span and not growing and
                  _quantile(latencies, 0.50) <= LAGGING_SECS),
      'latency_p50': _quantile(latencies, 0.50),
      'latency_p99': _quantile(latencies, 0.99),
      'windows': len(ends),
      'cores': cores,
      'cpu_secs_per_million': (c1 - c0) * 1e6 / max(emitted, 1),
  }
  for key in ('batches', 'batch_min_ms', 'batch_mean_ms', 'batch_max_ms'
              ) + HOW:
    if key in stats:
      summary[key] = stats[key]
  return summary


def _at(series: list, t: float) -> float:
  """The series' value at time ``t`` (the last sample before it)."""
  value = series[0][1] if series else 0.0
  for when, v in series:
    if when > t:
      break
    value = v
  return value


def _quantile(values: list[float], q: float) -> float:
  return values[min(len(values) - 1, int(q * len(values)))]


LABELS = {
    'ours': 'ours',
    'pyspark': 'PySpark (Arrow UDF, its default)',
    'pyspark-pickled': 'PySpark (pickled UDF, Arrow off)',
    'pyflink': 'PyFlink (its defaults)',
}
HEADER = ('| offered/s | system | counted/s | kept up | p50 (s) | p99 (s) '
          '| cores | CPU s per M events | micro-batch ms mean (max) '
          '| load before-after |')


def table(results: list[dict]) -> list[str]:
  """The results as Markdown table lines: a row per system and rate, kept
  up or not, with the 1-minute load average before and after its run."""
  lines = [HEADER, '|' + '---|' * HEADER.count(' | ') + '---|']
  for r in results:
    label = LABELS.get(r['variant'], r['variant'])
    load = f'{r["load_before"]:.1f}-{r["load_after"]:.1f}'
    if 'error' in r:
      reason = r['error'].strip().splitlines()[-1:] or ['?']
      lines.append(f'| {r["rate"]:,.0f} | {label} | - | no ({reason[0][-80:]})'
                   f' | | | | | | {load} |')
      continue
    batches = (f'{r["batch_mean_ms"]:.0f} ({r["batch_max_ms"]:.0f})'
               if 'batch_mean_ms' in r and 'batch_max_ms' in r else '')
    lines.append(
        f'| {r["rate"]:,.0f} | {label} | {r["records_per_sec"]:,.0f} '
        f'| {"yes" if r["kept_up"] else "no"} | {r["latency_p50"]:.2f} | '
        f'{r["latency_p99"]:.2f} | {r["cores"]:.2f} | '
        f'{r["cpu_secs_per_million"]:.1f} | {batches} | {load} |')
  return lines


def run_variant(variant: str, rate: float, args, python: str) -> dict:
  """One (variant, rate) in a fresh process, summarized (an error row if
  it failed or counted nothing after its warm-up)."""
  stats = None
  for attempt in range(2):
    try:
      stats = run_once(variant, rate, args.seconds, args.lead, args.master,
                       python, args.ours_flag)
      row = summarize(stats, rate, args.seconds, args.warmup, variant)
    except RuntimeError as exn:
      row = {'error': str(exn)[-400:]}
      # Spark waits 10 s at most for a Python process it starts (its
      # streaming source's): on a loaded machine, once more.
      if 'failed to connect back' in str(exn) and attempt == 0:
        print(f'{variant} at {rate}/s: Spark\'s Python worker did '
              'not connect back in time; once more', flush=True)
        continue
    break
  if 'error' not in row:  # the raw data, for another summary
    row['raw'] = {k: stats[k] for k in ('start', 'panes', 'cpu',
                                        'micro_batches') if k in stats}
  else:
    row['kept_up'] = False
    # How it ran, from inside it, even when it counted nothing in time.
    row.update({k: stats[k] for k in HOW if k in (stats or {})})
  return row


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rates', default='100000,200000,400000,800000')
  parser.add_argument('--seconds', type=float, default=45)
  parser.add_argument('--warmup', type=float, default=15)
  parser.add_argument('--lead', type=float, default=25,
                      help='ours: seconds from the job start to the events')
  parser.add_argument('--repeats', type=int, default=1)
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help=f'any of {", ".join(VARIANTS)}')
  parser.add_argument('--master', default='local[2]')
  parser.add_argument('--flink-python', default=FLINK_PYTHON,
                      help='a Python with apache-flink (make bench-flink)')
  parser.add_argument('--ours-flag', action='append', default=[],
                      help='an extra pipeline option for ours (repeatable)')
  parser.add_argument('--json', help='Also write the results here.')
  args = parser.parse_args(argv)
  rates = [float(r) for r in args.rates.split(',')]
  variants = args.variants.split(',')
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    parser.error(f'unknown variant(s) {unknown}: any of {list(VARIANTS)}')
  if 'pyflink' in variants and not os.path.exists(args.flink_python):
    parser.error(f'no {args.flink_python} for pyflink: `make bench-flink` '
                 'makes one, or pass --flink-python, or leave pyflink out '
                 'of --variants')
  if any(v.startswith('pyspark') for v in variants):
    try:
      import pandas  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
      import pyarrow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError as exn:
      parser.error(f'{exn}: the PySpark peer runs as PySpark users install '
                   "it (pyspark[sql]: pyarrow, pandas); pip install -e "
                   "'.[bench]'")
  results, turn = [], 0
  for rate in rates:
    for repeat in range(args.repeats):
      order = variants[turn % len(variants):] + variants[:turn %
                                                         len(variants)]
      turn += 1
      for variant in order:
        python = (args.flink_python if variant == 'pyflink' else
                  sys.executable)
        started = time.monotonic()
        load_before = os.getloadavg()[0]
        row = run_variant(variant, rate, args, python)
        row.update(variant=variant, rate=rate, repeat=repeat,
                   process_secs=time.monotonic() - started,
                   load_before=load_before, load_after=os.getloadavg()[0])
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != 'raw'},
                         sort_keys=True), flush=True)
  print()
  for variant in variants:  # how each peer ran, from inside it
    for r in results:
      how = {k: r[k] for k in HOW if k in r}
      if r['variant'] == variant and how:
        print(f'{variant}: {json.dumps(how, sort_keys=True)}')
        break
  print()
  print('\n'.join(table(results)))
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
