"""A stateful stage's and a keyed Reshuffle's elements by their encoded key
(the partitions are chosen by its stable hash, spark.partitioning)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from beam_pyspark.spark.partitioning import stable_hash
from beam_pyspark.worker import elements

if TYPE_CHECKING:
  from beam_pyspark.spark.tasks import TaskContext


class KeyElements:
  """Materialized KV chunks -> (encoded key, (input id, element))."""
  def __init__(self, ctx: TaskContext, coder_id: str, transform_id: str):
    self.ctx = ctx
    self.coder_id = coder_id
    self.transform_id = transform_id

  def __call__(self, chunks):
    runtime = self.ctx.runtime()
    impl = runtime.coder_impl(self.coder_id)
    key_impl = runtime.coder(
        self.coder_id).wrapped_value_coder.key_coder().get_impl()
    for key, element in elements.keyed_elements(impl, key_impl, chunks):
      yield key, (self.transform_id, element)


def pack_tagged(records):
  """(key, (input id, element)) -> (input id, chunk), one chunk per id."""
  by_input: dict[str, list[bytes]] = {}
  for _, (transform_id, element) in records:
    by_input.setdefault(transform_id, []).append(element)
  for transform_id, encoded in by_input.items():
    for chunk in elements.pack(encoded):
      yield transform_id, chunk


class KeyedSpread:
  """A keyed Reshuffle's map side: chunks -> (target partition, chunk),
  each element to its key's partition (the stable hash of its encoded
  key), packed in chunks per partition as the even deal packs them
  (tasks.SpreadElements), not pickled one by one."""
  def __init__(self, ctx: TaskContext, coder_id: str, partitions: int):
    self.ctx = ctx
    self.coder_id = coder_id
    self.partitions = partitions

  def __call__(self, chunks):
    n = self.partitions
    targets: list[list[bytes]] = [[] for _ in range(n)]
    for key, (_, element) in KeyElements(self.ctx, self.coder_id, '')(chunks):
      targets[stable_hash(key) % n].append(element)
    for target, encoded in enumerate(targets):
      for chunk in elements.pack(encoded):
        yield target, chunk
