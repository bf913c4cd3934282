"""Pipelines that tests/test_cluster.py runs as programs, on the cluster.

Run as ``python cluster_pipelines.py MODE --output PATH [pipeline options]``
so that the pipeline's code lives in ``__main__``, as a user's would: its
DoFns travel by value (cloudpickle), and whatever else they need must reach
the executors as staged dependencies.

Modes:
  imports   DoFns import the modules named by --modules (which only staged
            packages provide) and report their versions, the coder that the
            executor's coder registry gives for Point (the custom coder only
            if the pickled main session was loaded there) and the Python
            worker's pid. --register_coder registers that coder in __main__.
  failures  a job whose tasks stall at marked points on their first attempt,
            for the test to kill the executor (or the Python worker) that
            runs them; its DoFn records every bundle finalization.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions


class Point:
  def __init__(self, x):
    self.x = x


class PointCoder(beam.coders.Coder):
  def encode(self, value):
    return str(value.x).encode()

  def decode(self, encoded):
    return Point(int(encoded))

  def is_deterministic(self):
    return True


class ReportImports(beam.DoFn):
  def __init__(self, modules):
    self.modules = modules

  def process(self, element):
    import importlib
    versions = {}
    for name in self.modules:
      module = importlib.import_module(name)
      versions[name] = [module.VERSION, module.__file__]
    yield json.dumps({
        'element': element,
        'versions': versions,
        'coder': type(beam.coders.registry.get_coder(Point)).__name__,
        'pid': os.getpid(),
    })


def imports_pipeline(p, args):
  modules = [m for m in args.modules.split(',') if m]
  _ = (
      p
      | beam.Create(range(args.elements))
      | beam.Reshuffle()
      | beam.ParDo(ReportImports(modules))
      | beam.io.WriteToText(args.output))


def _append(path, record):
  # One short line per write in O_APPEND mode: lines from concurrent
  # processes never interleave.
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  try:
    os.write(fd, (json.dumps(record) + '\n').encode())
  finally:
    os.close(fd)


def _task():
  """Where this runs: Spark's view of the task attempt."""
  from pyspark import TaskContext
  ctx = TaskContext.get()
  if ctx is None:
    return {}
  return {
      'stage': ctx.stageId(), 'partition': ctx.partitionId(),
      'attempt': ctx.attemptNumber(), 'task': ctx.taskAttemptId()}


def _stall_once(markers, name):
  """On the first attempt only: say where we are, then wait to be killed."""
  marker = os.path.join(markers, name)
  try:
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    return  # a retry: go on
  os.write(fd, json.dumps({'pid': os.getpid(), **_task()}).encode())
  os.close(fd)
  time.sleep(600)


class StallAndFinalize(beam.DoFn):
  """Stalls on stall_on's first attempt; each bundle asks to be finalized
  and its finalization records the bundle's elements."""
  def __init__(self, markers, stall_on):
    self.markers = markers
    self.stall_on = stall_on

  def start_bundle(self):
    self.elements = None

  def process(self, element, finalizer=beam.DoFn.BundleFinalizerParam):
    if self.elements is None:
      self.elements = elements = []
      where = {'pid': os.getpid(), **_task()}
      path = os.path.join(self.markers, 'finalized.jsonl')
      finalizer.register(
          lambda: _append(path, {'elements': elements, **where}))
    if element == self.stall_on:
      _stall_once(self.markers, 'executor')
    self.elements.append(element)
    yield element


class StallGroup(beam.DoFn):
  def __init__(self, markers, stall_on):
    self.markers = markers
    self.stall_on = stall_on

  def process(self, kv):
    key, values = kv
    if key == self.stall_on:
      _stall_once(self.markers, 'python-worker')
    for v in sorted(values):
      yield f'{key}:{v}'


def failures_pipeline(p, args):
  _ = (
      p
      | beam.Create(range(args.elements))
      | 'Spread' >> beam.Reshuffle()
      | beam.ParDo(StallAndFinalize(args.markers, args.elements // 2))
      | beam.Map(lambda x: (x % 7, x))
      | beam.GroupByKey()
      | beam.ParDo(StallGroup(args.markers, 3))
      | beam.io.WriteToText(args.output))


def main(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument('mode', choices=['imports', 'failures'])
  parser.add_argument('--output', required=True)
  parser.add_argument('--modules', default='')
  parser.add_argument('--elements', type=int, default=8)
  parser.add_argument('--markers', default='')
  parser.add_argument('--register_coder', action='store_true')
  args, pipeline_args = parser.parse_known_args(argv)
  if args.register_coder:
    # In __main__ only: executors learn of it only from the pickled main
    # session (with cloudpickle it carries the coder registry).
    beam.coders.registry.register_coder(Point, PointCoder)
  options = PipelineOptions(pipeline_args)
  with beam.Pipeline(options=options) as p:
    {'imports': imports_pipeline, 'failures': failures_pipeline}[args.mode](
        p, args)


if __name__ == '__main__':
  main(sys.argv[1:])
