"""A bounded read's Split stage: the source's splits as an RDD.

As Beam's Spark runner (``SourceRDD.Bounded``) and Flink runner
(``SourceInputFormat``) do, the source is split on the driver into bundles
of ``estimate_size() / parallelism`` bytes (at least ``MIN_SPLIT_BYTES``;
``DEFAULT_SPLIT_BYTES`` when the source cannot estimate its size).  The
splits are packed into at most ``parallelism`` partitions by weight, largest
first, and each becomes one encoded element of the Split stage's output
buffer; the stage that consumes it reads the splits in the SDK harness
(``worker.reads``).  No Spark job is spent on it.

A source the driver cannot unpickle or split (its module may only be among
the job's staged dependencies, which executors install) is split in one
executor task instead.
"""

from __future__ import annotations

import logging
import math
import traceback
from typing import Optional

from apache_beam.internal import pickler
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.transforms.window import GlobalWindows
from google.protobuf import wrappers_pb2

from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.spark.partitioning import pack_by_size
from beam_pyspark.worker import elements
from beam_pyspark.worker.reads import encode_split

_LOGGER = logging.getLogger(__name__)

DEFAULT_SPLIT_BYTES = 64 << 20
MIN_SPLIT_BYTES = 1 << 20


def desired_split_bytes(estimated_size: Optional[int], parallelism: int) -> int:
  if not estimated_size or estimated_size <= 0:
    return DEFAULT_SPLIT_BYTES
  return max(MIN_SPLIT_BYTES, math.ceil(estimated_size / max(1, parallelism)))


def split_source(read_payload: bytes, parallelism: int):
  """(estimated size or None, desired split bytes, [(weight, encoded split)])."""
  payload = beam_runner_api_pb2.ReadPayload.FromString(read_payload)
  if payload.source.urn != python_urns.PICKLED_SOURCE:
    raise ValueError(f'not a pickled Python source: {payload.source.urn}')
  # Beam wraps the pickled source in a BytesValue (urns.RunnerApiFn):
  # unpickling the payload itself only worked while the wrapper's length
  # bytes were no base64 characters (not for 64-127 byte pickles, say).
  source = pickler.loads(
      wrappers_pb2.BytesValue.FromString(payload.source.payload).value)
  try:
    estimated = source.estimate_size()
  except NotImplementedError:
    estimated = None
  desired = desired_split_bytes(estimated, parallelism)
  splits = [(
      float(bundle.weight or 0.0),
      encode_split(bundle.source, bundle.start_position, bundle.stop_position))
            for bundle in source.split(desired)]
  return estimated, desired, splits


class SplitInTask:
  """flatMap over one dummy element: :func:`split_source` in an executor,
  with the job's staged dependencies active."""
  def __init__(self, ctx, read_payload: bytes, parallelism: int):
    self.ctx = ctx
    self.read_payload = read_payload
    self.parallelism = parallelism

  def __call__(self, _):
    self.ctx.runtime()
    yield split_source(self.read_payload, self.parallelism)


def split_rdd(sc, ctx, runtime, stage: StagePlan, parallelism: int, log,
              action):
  """The RDD of the Split stage's output: one encoded element per split.

  ``log(text)`` sends a job message; ``action(fn)`` runs a Spark action the
  way the job runs every other (cancellation, the user's traceback).
  """
  try:
    estimated, desired, splits = split_source(stage.read_payload, parallelism)
  except Exception as exn:  # pylint: disable=broad-except
    log(f'{stage.name}: the driver could not split the source '
        f'({type(exn).__name__}: {exn}); splitting it in an executor')
    _LOGGER.debug('Splitting %s on the driver failed:\n%s', stage.name,
                  traceback.format_exc())
    task = SplitInTask(ctx, stage.read_payload, parallelism)
    (estimated, desired, splits), = action(
        lambda: sc.parallelize([0], 1).flatMap(task).collect())

  (out_id, _), = stage.outputs.items()
  impl = runtime.coder_impl(stage.output_coders[out_id])
  encoded = [
      b''.join(
          elements.encode_stream(impl, [GlobalWindows.windowed_value(split)]))
      for _, split in splits
  ]
  bins = pack_by_size(_weights([weight for weight, _ in splits]), parallelism)
  size = 'unknown' if estimated is None else f'{estimated}'
  log(f'{stage.name}: {len(splits)} splits of the source (desired '
      f'{desired} bytes each, estimated size {size} bytes), packed into '
      f'{len(bins)} partitions by weight')
  packed = [[encoded[i] for i in b] for b in bins] or [[]]
  return sc.parallelize(packed, len(packed)).flatMap(_identity)


def _weights(weights: list[float]) -> list[float]:
  """Splits without a weight weigh what the others do on average (1 if
  none has one), so that they are spread rather than piled in one bin."""
  known = [w for w in weights if w > 0]
  fill = sum(known) / len(known) if known else 1.0
  return [w if w > 0 else fill for w in weights]


def _identity(x):
  return x
