"""The benchmark workloads, each written once for Beam and once by hand for
PySpark's RDD API.

Both versions read the same files, do the same per-record work with the
same module-level functions, and write text files, so the only difference
is the engine.  Outputs are compared by an order-independent digest of
their lines (see ``digest``).

The per-record functions live in ``benchmarks.records``, which imports no
Beam: both versions pickle them by reference, so executors and DirectRunner
workers import that module (``benchmarks`` must be importable there;
``run`` sets PYTHONPATH), and the hand-written jobs' workers stay free of
Beam.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import operator
import os
from typing import Callable
from typing import Optional

import apache_beam as beam
from apache_beam.io import ReadFromText
from apache_beam.io import WriteToText

from benchmarks.records import JoinFact
from benchmarks.records import format_count
from benchmarks.records import extract_words
from benchmarks.records import format_sum
from benchmarks.records import join_fact
from benchmarks.records import pair_one
from benchmarks.records import parse_comma_kv
from benchmarks.records import parse_dim
from benchmarks.records import parse_tab_kv
from benchmarks.records import split_words
from benchmarks.records import summarize_group

# -- the workloads --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  description: str
  # Corpus kinds read, by role; see benchmarks.corpus.
  inputs: dict[str, str]
  # (pipeline, input paths by role, output prefix) -> None: builds the graph.
  beam: Callable
  # (SparkContext, input paths by role, output directory) -> None: runs it.
  pyspark: Callable
  # (pipeline flags, input paths by role, output prefix) -> None: runs a
  # pipeline program of its own instead of building on ``beam``'s graph.
  program: Optional[Callable] = None


def _beam_wordcount(p, paths, output):
  (
      p
      | 'Read' >> ReadFromText(paths['text'])
      | 'Split' >> beam.FlatMap(split_words)
      | 'PairWithOne' >> beam.Map(pair_one)
      | 'Count' >> beam.CombinePerKey(sum)
      | 'Format' >> beam.Map(format_count)
      | 'Write' >> WriteToText(output))


def _spark_wordcount(sc, paths, output):
  (
      sc.textFile(paths['text']).flatMap(split_words).map(pair_one)
      .reduceByKey(operator.add).map(format_count).saveAsTextFile(output))


def _beam_group(p, paths, output):
  (
      p
      | 'Read' >> ReadFromText(paths['grouped'])
      | 'Parse' >> beam.Map(parse_tab_kv)
      | 'Group' >> beam.GroupByKey()
      | 'Summarize' >> beam.Map(summarize_group)
      | 'Write' >> WriteToText(output))


def _spark_group(sc, paths, output):
  (
      sc.textFile(paths['grouped']).map(parse_tab_kv).groupByKey()
      .map(summarize_group).saveAsTextFile(output))


def _beam_join(p, paths, output):
  dims = (
      p
      | 'ReadDims' >> ReadFromText(paths['dims'])
      | 'ParseDims' >> beam.Map(parse_dim))
  (
      p
      | 'ReadFacts' >> ReadFromText(paths['facts'])
      | 'Join' >> beam.FlatMap(join_fact, beam.pvalue.AsDict(dims))
      | 'Write' >> WriteToText(output))


def _spark_join(sc, paths, output):
  dims = sc.broadcast(dict(sc.textFile(paths['dims']).map(parse_dim).collect()))
  try:
    sc.textFile(paths['facts']).flatMap(JoinFact(dims)).saveAsTextFile(output)
  finally:
    dims.destroy()


def _beam_combine(p, paths, output):
  (
      p
      | 'Read' >> ReadFromText(paths['numbers'])
      | 'Parse' >> beam.Map(parse_comma_kv)
      | 'Sum' >> beam.CombinePerKey(sum)
      | 'Format' >> beam.Map(format_sum)
      | 'Write' >> WriteToText(output))


def _spark_combine(sc, paths, output):
  (
      sc.textFile(paths['numbers']).map(parse_comma_kv)
      .reduceByKey(operator.add).map(format_sum).saveAsTextFile(output))


def _beam_wordcount_example(flags, paths, output):
  """Beam's own WordCount example, unchanged: its ``run``, as ``python -m
  apache_beam.examples.wordcount`` calls it (but for its main session,
  which is this program's, not the example's: its DoFn is pickled by
  reference to the example's module)."""
  from apache_beam.examples import wordcount  # pylint: disable=import-outside-toplevel
  wordcount.run(['--input', paths['text'], '--output', output] + flags,
                save_main_session=False)


def _spark_wordcount_example(sc, paths, output):
  """The example's work by hand: its regular expression as it calls it."""
  (
      sc.textFile(paths['text']).flatMap(extract_words).map(pair_one)
      .reduceByKey(operator.add).map(format_count).saveAsTextFile(output))


WORKLOADS = {
    w.name: w
    for w in [
        Workload(
            'wordcount', 'WordCount over Zipf-like text (CombinePerKey(sum))',
            {'text': 'text'}, _beam_wordcount, _spark_wordcount),
        Workload(
            'wordcount_example',
            'Beam\'s apache_beam.examples.wordcount, unchanged (a DoFn of '
            'its own)', {'text': 'text'}, None, _spark_wordcount_example,
            program=_beam_wordcount_example),
        Workload(
            'groupbykey',
            'GroupByKey, 500 keys with many int values each, summarized',
            {'grouped': 'grouped'}, _beam_group, _spark_group),
        Workload(
            'sideinput_join',
            'Join facts to a 100k-row table through an AsDict side input',
            {'facts': 'facts', 'dims': 'dims'}, _beam_join, _spark_join),
        Workload(
            'combine', 'CombinePerKey(sum) over ints, 100k keys',
            {'numbers': 'numbers'}, _beam_combine, _spark_combine),
    ]
}

# -- running and checking -------------------------------------------------------


def run_beam(workload: Workload, flags: list[str], paths, output: str) -> None:
  if workload.program is not None:
    workload.program(flags, paths, output)
    return
  from apache_beam.options.pipeline_options import PipelineOptions
  options = PipelineOptions(flags)
  p = beam.Pipeline(options=options)
  workload.beam(p, paths, output)
  result = p.run()
  result.wait_until_finish()


# Hand-written jobs run in Python workers of their own.  Spark keeps one
# pool of Python workers per (interpreter, environment), so an extra
# environment variable gives them a pool whose workers never imported Beam.
# In the runner's pool, PySpark's daemon runs gc.collect() after every task
# over Beam's larger heap (see docs/benchmarks.md): a cost of running Beam,
# which hand-written code would not pay.
POOL_VARIABLE = 'BEAM_PYSPARK_BENCH_POOL'
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def handwritten_pool(sc):
  """Python workers for hand-written jobs, able to import ``benchmarks``.
  The runner's release of a job's harnesses (a Spark job of its own, from
  a thread) reads the environment as it starts: it is waited for first."""
  from beam_pyspark.spark import release  # pylint: disable=import-outside-toplevel
  release.wait_for_releases(30.0)
  env = sc.environment
  saved = {k: env.get(k) for k in (POOL_VARIABLE, 'PYTHONPATH')}
  env[POOL_VARIABLE] = 'hand-written'
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in [REPO_ROOT, saved['PYTHONPATH']] if p)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        env.pop(k, None)
      else:
        env[k] = v


def run_pyspark(workload: Workload, sc, paths, output: str) -> None:
  with handwritten_pool(sc):
    workload.pyspark(sc, paths, output)


def output_files(output: str) -> list[str]:
  """Beam writes ``output-SSSSS-of-NNNNN``; Spark writes ``output/part-*``."""
  if os.path.isdir(output):
    return sorted(glob.glob(os.path.join(output, 'part-*')))
  return sorted(glob.glob(output + '-*-of-*'))


@dataclasses.dataclass(frozen=True)
class Digest:
  lines: int
  checksum: int  # sum of 64-bit line hashes, mod 2**64: order-independent

  def __str__(self):
    return f'{self.lines} lines, {self.checksum:016x}'


def digest(output: str) -> Digest:
  lines = 0
  total = 0
  for path in output_files(output):
    with open(path, 'rb') as f:
      for line in f:
        lines += 1
        total += int.from_bytes(
            hashlib.blake2b(line.rstrip(b'\n'), digest_size=8).digest(), 'little')
  return Digest(lines, total % (1 << 64))
