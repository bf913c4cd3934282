"""Run one fused stage in this process on the SDK harness and on the fast
path, and compare what each writes (tests/test_fast_path*.py)."""

from __future__ import annotations

import functools
import logging
import os
import uuid

import apache_beam as beam
from apache_beam.metrics import monitoring_infos as mi
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.common import ENCODED_IMPULSE_VALUE
from apache_beam.transforms import environments
from apache_beam.transforms import window

from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.spark.reads import split_source
from beam_pyspark.worker import elements
from beam_pyspark.worker import fastpath
from beam_pyspark.worker import harnesses
from beam_pyspark.worker import shuffle
from beam_pyspark.worker.bundles import DEFAULT_BUNDLE_BYTES
from beam_pyspark.worker.bundles import StageRunner
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.state import side_input_entries

from conftest import spark_options


class Planned:
  """The one fast-path stage of a pipeline (the one whose name has
  ``label``; else the one not on a GroupByKey's reduce side), run on
  either side.

  ``sides``: the elements of each side input the stage reads, by tag;
  ``inputs``: its input elements, where it reads another stage's output;
  ``bundle_bytes``: where both sides cut bundles.
  """
  def __init__(self, build, label=None, sides=None, inputs=None,
               bundle_bytes=DEFAULT_BUNDLE_BYTES):
    p = beam.Pipeline()
    build(p)
    self.plan = plan_pipeline(p.to_runner_api(
        default_environment=environments.EmbeddedPythonEnvironment.default()))
    self.job_id = f'fast-test-{uuid.uuid4().hex[:8]}'
    self.runtime = JobRuntime(self.job_id, self.plan.components)
    self.bundle_bytes = bundle_bytes
    chosen, self.note = fastpath.choose(self.plan.stages, self.runtime)
    # (Without a label: the one stage not reading a GroupByKey's output.)
    names = [n for n in chosen if label in n] if label is not None else [
        n for n in chosen if not chosen[n].grouped]
    assert len(names) == 1, (label, list(chosen), self.note)
    (self.stage, ) = [s for s in self.plan.stages if s.name == names[0]]
    self.spec = chosen[names[0]]
    (input_id, buffer_id), = self.stage.inputs.items()
    # (The SDK's coder: the runner-safe one may see the elements as bytes.)
    impl = self.runtime.coder_impl(self.spec.input_coder_id)
    if buffer_id == IMPULSE_BUFFER:
      self.inputs = [(input_id, ENCODED_IMPULSE_VALUE)]
    elif inputs is not None:
      self.inputs = [(input_id, chunk) for chunk in elements.encode_stream(
          impl, [v if isinstance(v, window.WindowedValue) else
                 window.GlobalWindows.windowed_value(v) for v in inputs],
          limit=max(1, bundle_bytes // 4))]
    else:  # a read's splits, split as the driver splits them
      (read, ) = [s for s in self.plan.stages if buffer_id in s.outputs.values()]
      _, _, splits = split_source(read.read_payload, 2)
      self.inputs = [
          (input_id, chunk) for _, split in splits
          for chunk in elements.encode_stream(
              impl, [window.GlobalWindows.windowed_value(split)])]
    self.outputs = dict(self.stage.outputs)
    self.groups = {}
    for output_id, buffer in self.outputs.items():
      coder = self.runtime.coder(self.stage.output_coders[output_id])
      if buffer.startswith(b'group'):
        self.groups[output_id] = (3, shuffle.is_global_bytes_kv(coder))
    if len(self.outputs) == 1:
      (self.output_id, ) = self.outputs
      self.grouped = self.output_id in self.groups
      self.compact = self.grouped and self.groups[self.output_id][1]
    self.sides = []
    for spec in self.stage.side_inputs:
      # Encoded as the stage writing the side input's buffer encodes them.
      (producer, ) = [s for s in self.plan.stages
                      if spec.buffer_id in s.outputs.values()]
      (write, ) = [t for t, b in producer.outputs.items()
                   if b == spec.buffer_id]
      port = beam_fn_api_pb2.RemoteGrpcPort.FromString(
          beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
              producer.descriptor).transforms[write].spec.payload)
      side_impl = self.runtime.coder_impl(port.coder_id)
      chunks = elements.encode_stream(
          side_impl, [window.GlobalWindows.windowed_value(v)
                      for v in (sides or {})[spec.tag]])
      self.sides.append(side_input_entries(self.runtime, spec, chunks))

  def harness(self, plan, on_finish):
    return StageRunner(self.job_id, self.runtime, plan,
                       side_inputs=self.sides, on_finish=on_finish,
                       bundle_bytes=self.bundle_bytes)

  def run(self, fast: bool, release: bool = True):
    """(sorted output records or elements, element counts, user metrics,
    error text or None); outputs of a stage with several are a dict."""
    results, raw, error = [], [], None
    try:
      if fast:
        self.last = fastpath.FastStage(
            self.runtime, self.stage, self.spec, self.groups, self.sides,
            bundle_bytes=self.bundle_bytes)
        raw = list(self.last.run(
            iter(self.inputs), self.harness, results.append))
      else:
        raw = list(self.harness(self.stage, results.append).run(self.inputs))
    except Exception as exn:  # pylint: disable=broad-except
      error = str(exn)
    finally:
      if release:
        harnesses.release_job(self.job_id)
    infos = results[0].monitoring_infos if results else []
    counts = {
        m.labels['PCOLLECTION']: mi.extract_counter_value(m)
        for m in infos if m.urn == mi.ELEMENT_COUNT_URN}
    user = {}
    for m in infos:
      if not mi.is_user_monitoring_info(m):
        continue
      key = (m.labels['PTRANSFORM'], m.labels['NAME'])
      if m.urn == mi.USER_COUNTER_URN:
        user[key] = mi.extract_counter_value(m)
      elif m.urn == mi.USER_DISTRIBUTION_URN:
        user[key] = mi.extract_distribution(m)[:1]  # the count: times vary
      else:
        user[key] = m.payload
    by_output = {o: self._normalize(o, [c for t, c in raw if t == o])
                 for o in self.outputs}
    out = by_output[self.output_id] if len(by_output) == 1 else by_output
    return out, counts, user, error

  def _normalize(self, output_id, raw):
    """Byte strings, sorted: shuffle records as RunStage packs them, or
    the encoded elements."""
    coder_id = self.stage.output_coders[output_id]
    impl = self.runtime.coder_impl(coder_id)
    group = self.groups.get(output_id)
    if group is None:
      return sorted(elements.split_elements(impl, raw))
    if group[1]:
      to_records = shuffle.kv_value_records
    else:
      to_records = functools.partial(
          shuffle.keyed_records, impl,
          self.runtime.coder(coder_id).wrapped_value_coder.key_coder().get_impl())
    packer = shuffle.PartitionPacker(3)
    packed = []
    for chunk in raw:
      if type(chunk) is tuple:  # pylint: disable=unidiomatic-typecheck
        packed.append(chunk)
      else:
        packed.extend(packer.add(to_records([chunk])))
    packed.extend(packer.flush())
    return sorted((p, ) + record for p, chunk in packed
                  for record in shuffle.unpack_records([chunk]))

  @property
  def fell_back(self):
    """The last fast run's fallback (None: the loop ran it all)."""
    handover = self.last.handover
    return handover.fallback if handover is not None else 'not loaded'

  def compare(self, fallback: bool = False):
    """Runs both sides; asserts they agree (and that the loop ran the
    whole partition, unless ``fallback``); returns the harness's run."""
    on_harness = self.run(fast=False)
    on_fast = self.run(fast=True)
    if not fallback:
      assert self.fell_back is None, self.fell_back
    assert on_fast[0] == on_harness[0]
    assert on_fast[1] == on_harness[1]
    assert on_fast[2] == on_harness[2]
    assert first_line(on_fast[3]) == first_line(on_harness[3])
    return on_harness


def first_line(error):
  return None if error is None else error.strip().splitlines()[0]


def run_on_and_off(build, tmp_path):
  """Runs ``build(p, output)`` on local[2] with the fast path on and off;
  returns for each (sorted output lines, element counts, user counters
  and distributions' counts, the runner's messages)."""
  outcomes = []
  for flags in ({}, {'no_fast_path': True}):
    out = str(tmp_path / f'out{len(flags)}')
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger('beam_pyspark.runner')
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
      p = beam.Pipeline(options=spark_options(**flags))
      build(p, out)
      result = p.run()
      result.wait_until_finish()
    finally:
      logger.removeHandler(handler)
      logger.setLevel(level)
    lines = []
    for name in sorted(os.listdir(tmp_path)):
      if name.startswith(f'out{len(flags)}'):
        with open(tmp_path / name, encoding='utf-8') as f:
          lines.extend(f.read().splitlines())
    infos = result.monitoring_infos()
    counts = {m.labels['PCOLLECTION']: mi.extract_counter_value(m)
              for m in infos if m.urn == mi.ELEMENT_COUNT_URN}
    query = result.metrics().query()
    user = {str(r.key): r.committed for r in query['counters']}
    user.update({str(r.key): r.committed.count
                 for r in query['distributions']})
    outcomes.append((sorted(lines), counts, user, messages))
  return outcomes
