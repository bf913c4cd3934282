"""The pipeline proto as fusion should see it: a copy, rewritten.

Pure proto work before Beam's fusion phases (plan.fuse): no Spark, no
gRPC.
"""

from __future__ import annotations

import copy

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners import pipeline_utils


def normalized(
    pipeline: beam_runner_api_pb2.Pipeline) -> beam_runner_api_pb2.Pipeline:
  """A copy of ``pipeline``: its identical environments merged, its
  recoding Reshuffles expanded."""
  pipeline = copy.deepcopy(pipeline)
  # Identical environments as one, as Beam's FnApiRunner and Python SDK do
  # (pipeline_utils): fusion fuses only within one environment id, so 150
  # ParDos each in its own copy of one environment were 150 stages, which
  # Spark chained into one task function nested 150 deep that its pickler
  # refused ("excessively deep recursion required"). The id kept is one of
  # the pipeline's own: stages' environments are still found in it.
  pipeline_utils.merge_common_environments(pipeline, inplace=True)
  _expand_recoding_reshuffles(pipeline)
  return pipeline


def _coder_key(components, coder_id: str, depth: int = 0):
  """A coder's structure (URN, payload, components), whatever its id."""
  coder = components.coders[coder_id]
  if depth > 50:
    raise ValueError(f'coder {coder_id!r} nests too deep')
  return (coder.spec.urn, coder.spec.payload, tuple(
      _coder_key(components, c, depth + 1) for c in coder.component_coder_ids))


def _expand_recoding_reshuffles(pipeline: beam_runner_api_pb2.Pipeline) -> None:
  """Runs as composites the Reshuffles whose output coder is not their
  input's.

  The runner moves a Reshuffle's elements as it sees them, in their
  runner-safe form, where an element type the SDK encodes (a NamedTuple
  key, with a deterministic pickling coder) is opaque bytes: the bytes of
  the input coder would reach a consumer decoding with another coder
  ("Unknown type tag" when a NamedTuple key went through Reshuffle). Such a
  Reshuffle runs its own expansion in the SDK (as Beam's runners do), which
  re-encodes; the others stay the runner's repartition.
  """
  components = pipeline.components
  urn = common_urns.composites.RESHUFFLE.urn
  for transform in components.transforms.values():
    if (transform.spec.urn != urn or not transform.subtransforms or
        len(transform.inputs) != 1 or len(transform.outputs) != 1):
      continue
    (pin,) = transform.inputs.values()
    (pout,) = transform.outputs.values()
    coder_in = components.pcollections[pin].coder_id
    coder_out = components.pcollections[pout].coder_id
    if coder_in != coder_out and (_coder_key(components, coder_in) !=
                                  _coder_key(components, coder_out)):
      transform.spec.Clear()
