"""The Connect engine against the RDD engine, side by side.

    python -m benchmarks.connect [--size-mb 200] [--repeats 3]
        [--workloads wordcount,groupbykey]

One process starts a Spark Connect server (tests/connect_server.py:
Spark's own plugin, local[2], its Python workers forked from the runner's
daemon) and a local[2] SparkContext of its own, then runs each workload
(benchmarks.workloads) with PySparkRunner on both, alternating which goes
first in each repeat: ``rdd`` (the RDD engine on the SparkContext) and
``connect`` (``--spark_remote``). Both Sparks are warm (a small run of
each first). Prints each run's wall time, the ratio connect / rdd of
each alternating pair and their median per workload, and checks that both wrote the same lines (a digest).

The two engines run in two JVMs of the same settings on the same cores,
never at once; on a shared machine read the ratios, not the times.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import corpus
from benchmarks import workloads as wl

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_MB = 0.5


def _flags(engine: str, url: str) -> list[str]:
  if engine == 'connect':
    return ['--runner=beam_pyspark.PySparkRunner', f'--spark_remote={url}',
            '--progress=off']
  return ['--runner=beam_pyspark.PySparkRunner', '--progress=off']


def import_paths() -> None:
  """Both engines' Python workers import benchmarks.records by reference;
  the tests' Connect server fixture (tests/connect_server.py) is imported
  here."""
  os.environ['PYTHONPATH'] = os.pathsep.join(
      p for p in [REPO_ROOT, os.environ.get('PYTHONPATH')] if p)
  sys.path.insert(0, os.path.join(REPO_ROOT, 'tests'))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--size-mb', type=float, default=200)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--workloads', default='wordcount,groupbykey')
  parser.add_argument('--out', default='out/bench/connect')
  args = parser.parse_args(argv)
  # Absolute: a Connect server runs its Python workers in a directory of
  # the session's own.
  args.out = os.path.abspath(args.out)
  os.makedirs(args.out, exist_ok=True)
  corpus_dir = os.path.join(args.out, 'corpus')
  import_paths()
  from connect_server import ConnectServer  # pylint: disable=import-outside-toplevel
  from beam_pyspark.spark.session import spark_context  # pylint: disable=import-outside-toplevel
  server_dir = tempfile.mkdtemp(prefix='bench-connect-')
  server = ConnectServer(server_dir, env={'PYTHONPATH': REPO_ROOT})
  try:
    spark_context('local[2]')
    names = args.workloads.split(',')
    results: dict[tuple[str, str], list[float]] = {}
    for name in names:
      workload = wl.WORKLOADS[name]
      for size, repeats in ((WARMUP_MB, 1), (args.size_mb, args.repeats)):
        paths = {role: corpus.ensure(corpus_dir, kind, size)
                 for role, kind in workload.inputs.items()}
        for repeat in range(repeats):
          order = ('rdd', 'connect') if repeat % 2 == 0 else ('connect', 'rdd')
          digests = {}
          for engine in order:
            output = os.path.join(args.out, 'runs', f'{name}-{engine}', 'out')
            shutil.rmtree(os.path.dirname(output), ignore_errors=True)
            os.makedirs(os.path.dirname(output))
            started = time.monotonic()
            wl.run_beam(workload, _flags(engine, server.url), paths, output)
            secs = time.monotonic() - started
            digests[engine] = wl.digest(output)
            label = 'warm-up' if size == WARMUP_MB else f'repeat {repeat}'
            print(f'{name:12} {engine:8} {size:g} MiB {label:9} '
                  f'{secs:8.2f} s  load {os.getloadavg()[0]:.1f}  '
                  f'{digests[engine]}', flush=True)
            if size != WARMUP_MB:
              results.setdefault((name, engine), []).append(secs)
          if digests['rdd'] != digests['connect']:
            raise SystemExit(f'{name}: outputs differ: {digests}')
    print()
    for name in names:
      rdd = statistics.median(results[(name, 'rdd')])
      connect = statistics.median(results[(name, 'connect')])
      ratios = [c / r for c, r in zip(results[(name, 'connect')],
                                      results[(name, 'rdd')])]
      # The median of the pairs' ratios: the load of a shared machine
      # moves both runs of a pair together more than it moves repeats.
      print(f'{name:12} {args.size_mb:g} MiB: rdd {rdd:.2f} s, connect '
            f'{connect:.2f} s (medians); connect/rdd per repeat '
            f'{", ".join(f"{r:.2f}" for r in ratios)}: median '
            f'{statistics.median(ratios):.2f}x')
  finally:
    server.stop()
    shutil.rmtree(server_dir, ignore_errors=True)


def run_and_exit(main_function) -> None:
  """Runs ``main_function``, then ends the process at once: the Connect
  client's thread pools would otherwise keep it alive at exit (retrying a
  server already stopped), holding the benchmark lock."""
  code = 1
  try:
    main_function()
    code = 0
  except SystemExit as exn:
    if isinstance(exn.code, int) or exn.code is None:
      code = exn.code or 0
    else:
      print(exn.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=import-outside-toplevel
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


if __name__ == '__main__':
  run_and_exit(main)
