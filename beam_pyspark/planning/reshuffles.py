"""Beam's Reshuffle as the runner moves it: which input it moves, which
Reshuffles run as their own expansion, and which keep keys together."""

from __future__ import annotations

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.planning.sdks import sdk_of


def main_input(reshuffle, producers_by_pcoll, split_urns) -> str:
  """The PCollection a Reshuffle moves: its only input, or, for the one
  expand_sdf inserts (which lists the ParDo's side inputs too), the sized
  restrictions made by SplitAndSizeRestrictions."""
  pcolls = list(reshuffle.inputs.values())
  if len(pcolls) == 1:
    return pcolls[0]
  sized = [
      p for p in pcolls if p in producers_by_pcoll and
      producers_by_pcoll[p].spec.urn in split_urns]
  if len(sized) != 1:
    raise ValueError(
        f'Reshuffle {reshuffle.unique_name!r} has {len(pcolls)} inputs and '
        f'{len(sized)} of them are split restrictions; expected exactly one.')
  return sized[0]


def keeps_keys(components: beam_runner_api_pb2.Components,
               reshuffle: beam_runner_api_pb2.PTransform) -> bool:
  """Whether a Reshuffle must keep each key's elements together.

  Java's ``Reshuffle.of()`` carries Beam's Reshuffle URN and is keyed: it
  expands to a GroupByKey, so a key's elements reach one bundle, and
  Java's ``WriteFiles`` relies on it (``GatherResults`` reshuffles every
  windowed file result onto one void key so that each window's results are
  finalized, and their shards numbered ``i-of-n``, in one list; spread
  over partitions, two lists of one window both named ``0-of-1`` and the
  second file overwrote the first). Python's and Go's Reshuffles carry the
  URN on their random-key form: their elements are dealt evenly.
  Told apart by the SDK of the transforms the Reshuffle expands to.
  """
  if components.coders[components.pcollections[tr.only_element(
      reshuffle.outputs.values())].coder_id].spec.urn != (
          common_urns.coders.KV.urn):
    return False
  stack = list(reshuffle.subtransforms)
  while stack:
    sub = components.transforms.get(stack.pop())
    if sub is None:
      continue
    env = components.environments.get(sub.environment_id)
    if env is not None:
      return sdk_of(env) == 'java'
    stack.extend(sub.subtransforms)
  return False


def expand_recoding(pipeline: beam_runner_api_pb2.Pipeline) -> None:
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


def _coder_key(components, coder_id: str, depth: int = 0):
  """A coder's structure (URN, payload, components), whatever its id."""
  coder = components.coders[coder_id]
  if depth > 50:
    raise ValueError(f'coder {coder_id!r} nests too deep')
  return (coder.spec.urn, coder.spec.payload, tuple(
      _coder_key(components, c, depth + 1) for c in coder.component_coder_ids))
