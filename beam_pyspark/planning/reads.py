"""Bounded reads: split by the runner, read in the harness without SDF.

Beam's Python SDK expands ``beam.io.Read(bounded_source)`` (ReadFromText and
the other file-based reads among them) into Impulse, a Map that emits the
source, and a splittable DoFn over it.  On a runner that costs a Spark job
that only collects restriction sizes (the ``sized`` reshuffle), and per
record a restriction tracker behind a lock, a watermark estimator and the
DoFn machinery.

Like Beam's Flink and Spark runners' bounded source translation, this
runner splits the source itself instead: the phase here replaces the read
composite's expansion with

* ``<read>/Split``, a runner stage (:data:`SPLIT_URN`, the composite's
  ReadPayload as payload): on the driver, ``source.split(estimate_size() /
  parallelism)``, splits packed into partitions by weight (``spark.reads``);
* ``<read>/SDFBoundedSourceReader/ParDo(SDFBoundedSourceDoFn)/Process``
  (named as Beam's reading step, so the source's metrics are reported under
  the step Beam's runners use), a transform of the SDK harness
  (:data:`READ_SPLIT_URN`, implemented in ``worker.reads``) whose input
  elements are the encoded splits; it reads each one and feeds the records straight to the transforms
  fused after it.

Only reads whose whole expansion runs in the embedded Python environment are
rewritten: the URN is known to this runner's in-process harness only, so
PROCESS, EXTERNAL and LOOPBACK environments keep Beam's SDF expansion.
Unbounded reads are left alone.
"""

from __future__ import annotations

from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.planning.validate import concrete_environment

READ_URN = common_urns.deprecated_primitives.READ.urn
# A runner transform: no input; output, the encoded splits of the source.
SPLIT_URN = 'beam_pyspark:runner:split_bounded_source:v1'
# A transform of the in-process SDK harness (worker.reads registers it):
# input, encoded splits; output, the records.
READ_SPLIT_URN = 'beam_pyspark:transform:read_bounded_source_split:v1'


def native_bounded_reads(
    stages: Iterable[tr.Stage], context: tr.TransformContext
) -> Iterator[tr.Stage]:
  """A fusion phase; must run first, while every stage is one leaf transform.

  The leaf stages of each eligible read composite give way to a Split stage
  and a stage reading the splits, where the composite's first leaf was.
  """
  components = context.components
  owner: dict[str, str] = {}  # leaf transform id -> read composite id
  for read_id in _eligible_reads(components):
    for leaf_id in _leaves(components, read_id):
      owner[leaf_id] = read_id
  done = set()
  for stage in stages:
    read_id = owner.get(stage.name) if len(stage.transforms) == 1 else None
    if read_id is None:
      yield stage
    elif read_id not in done:
      done.add(read_id)
      yield from _split_and_read(read_id, context)


def _eligible_reads(components: beam_runner_api_pb2.Components) -> list[str]:
  result = []
  for transform_id, transform in components.transforms.items():
    if transform.spec.urn != READ_URN or not transform.subtransforms:
      continue  # a leaf Read is read_to_impulse's
    if len(transform.outputs) != 1:
      continue
    payload = beam_runner_api_pb2.ReadPayload.FromString(transform.spec.payload)
    if (payload.is_bounded != beam_runner_api_pb2.IsBounded.BOUNDED or
        payload.source.urn != python_urns.PICKLED_SOURCE):
      continue
    envs = {
        components.transforms[leaf].environment_id
        for leaf in _leaves(components, transform_id)
    } - {''}
    if len(envs) != 1:
      continue
    env = components.environments.get(next(iter(envs)))
    if env is None or concrete_environment(env).urn != (
        python_urns.EMBEDDED_PYTHON):
      continue
    result.append(transform_id)
  return result


def _leaves(components, transform_id: str) -> list[str]:
  transform = components.transforms[transform_id]
  if not transform.subtransforms:
    return [transform_id]
  return [
      leaf for child in transform.subtransforms
      for leaf in _leaves(components, child)
  ]


def _split_and_read(read_id: str, context) -> Iterator[tr.Stage]:
  components = context.components
  read = components.transforms[read_id]
  out_pcoll = tr.only_element(read.outputs.values())
  env = next(
      components.transforms[leaf].environment_id
      for leaf in _leaves(components, read_id)
      if components.transforms[leaf].environment_id)
  splits_pcoll = tr.unique_name(
      components.pcollections, f'{read.unique_name}/Splits')
  components.pcollections[splits_pcoll].CopyFrom(
      beam_runner_api_pb2.PCollection(
          unique_name=splits_pcoll,
          coder_id=context.bytes_coder_id,
          windowing_strategy_id=components.pcollections[out_pcoll]
          .windowing_strategy_id,
          is_bounded=beam_runner_api_pb2.IsBounded.BOUNDED))
  split = beam_runner_api_pb2.PTransform(
      unique_name=f'{read.unique_name}/Split',
      spec=beam_runner_api_pb2.FunctionSpec(
          urn=SPLIT_URN, payload=read.spec.payload),
      outputs={'out': splits_pcoll})
  reader = beam_runner_api_pb2.PTransform(
      # The name of the step that reads in Beam's SDF expansion: metrics the
      # source reports (its records read...) are queried by step.
      unique_name=f'{read.unique_name}/{READER_STEP}',
      spec=beam_runner_api_pb2.FunctionSpec(urn=READ_SPLIT_URN),
      inputs={'in': splits_pcoll},
      outputs=dict(read.outputs),
      environment_id=env)
  yield tr.Stage(split.unique_name, [split], parent=read_id)
  yield tr.Stage(reader.unique_name, [reader], parent=read_id)


# Where Beam's own runners report a bounded source's metrics: the process
# step of Read's SDF expansion (iobase.SDFBoundedSourceReader).
READER_STEP = 'SDFBoundedSourceReader/ParDo(SDFBoundedSourceDoFn)/Process'


def split_transform(
    transforms: Iterable[beam_runner_api_pb2.PTransform]
) -> Optional[beam_runner_api_pb2.PTransform]:
  """The Split transform of a fused stage, if it is a Split stage."""
  for t in transforms:
    if t.spec.urn == SPLIT_URN:
      return t
  return None
