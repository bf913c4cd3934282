"""The benchmark workloads, each written once for Beam and once by hand for
PySpark's RDD API.

Both versions read the same files, do the same per-record work with the
same module-level functions, and write text files, so the only difference
is the engine.  Outputs are compared by an order-independent digest of
their lines (see ``digest``).

Functions used inside pipelines live at module level: Beam pickles them by
reference, so executors and DirectRunner workers import this module
(``benchmarks`` must be importable there; ``run`` sets PYTHONPATH).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import operator
import os
import re
from typing import Callable

import apache_beam as beam
from apache_beam.io import ReadFromText
from apache_beam.io import WriteToText

# -- per-record functions, shared by both versions ----------------------------

_WORD = re.compile(r"[\w']+", re.UNICODE)  # as Beam's examples/wordcount.py


def split_words(line: str) -> list[str]:
  return _WORD.findall(line)


def pair_one(word: str):
  return word, 1


def format_count(kv) -> str:
  return '%s: %d' % kv


def parse_tab_kv(line: str):
  key, value = line.split('\t', 1)
  return key, int(value)


def summarize_group(kv) -> str:
  """A GroupByKey's values: how many, their sum, min and max."""
  key, values = kv
  n = total = 0
  lo = hi = None
  for v in values:
    n += 1
    total += v
    if lo is None or v < lo:
      lo = v
    if hi is None or v > hi:
      hi = v
  return '%s\t%d\t%d\t%d\t%d' % (key, n, total, lo, hi)


def parse_comma_kv(line: str):
  key, value = line.split(',', 1)
  return key, int(value)


def format_sum(kv) -> str:
  return '%s,%d' % kv


def parse_dim(line: str):
  user, country = line.split(',', 1)
  return user, country


def join_fact(line: str, dims) -> list[str]:
  """order,user,amount -> order,user,country,amount; no match, no output."""
  order, user, amount = line.split(',')
  country = dims.get(user)
  if country is None:
    return []
  return ['%s,%s,%s,%s' % (order, user, country, amount)]


class JoinFact:
  """``join_fact`` over a broadcast dict, for the hand-written version."""
  def __init__(self, broadcast):
    self.broadcast = broadcast

  def __call__(self, line: str) -> list[str]:
    return join_fact(line, self.broadcast.value)


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


WORKLOADS = {
    w.name: w
    for w in [
        Workload(
            'wordcount', 'WordCount over Zipf-like text (CombinePerKey(sum))',
            {'text': 'text'}, _beam_wordcount, _spark_wordcount),
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
  from apache_beam.options.pipeline_options import PipelineOptions
  options = PipelineOptions(flags)
  p = beam.Pipeline(options=options)
  workload.beam(p, paths, output)
  result = p.run()
  result.wait_until_finish()


def run_pyspark(workload: Workload, sc, paths, output: str) -> None:
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
