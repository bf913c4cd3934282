"""A stateful stage's and a keyed Reshuffle's elements by their encoded key
(the partitions are chosen by its stable hash, spark.partitioning)."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def pack_by_key(records):
  """(key, (input id, element)) -> chunks, each key's elements together and
  in the order they came (a keyed Reshuffle's partition, sdks.reshuffle_keeps_keys)."""
  by_key: dict[bytes, list[bytes]] = {}
  for key, (_, element) in records:
    by_key.setdefault(key, []).append(element)
  yield from elements.pack(e for run in by_key.values() for e in run)
