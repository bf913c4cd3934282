"""Where user state lives between tasks: per task (batch) or in a store
the streaming engine owns. Servicer-level tests plus a stateful stage run
twice over one store by the real StageRunner and in-process harness."""

from __future__ import annotations

import uuid

import apache_beam as beam
from apache_beam.coders import BytesCoder
from apache_beam.coders.coders import LengthPrefixCoder
from apache_beam.coders import StrUtf8Coder
from apache_beam.coders import TupleCoder
from apache_beam.coders import VarIntCoder
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.transforms import environments
from apache_beam.transforms import userstate
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.worker import harnesses
from beam_pyspark.worker.bundles import StageRunner
from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.state import PerTaskState
from beam_pyspark.worker.state import StoredState


def _bag_key(key: bytes) -> beam_fn_api_pb2.StateKey:
  return beam_fn_api_pb2.StateKey(
      bag_user_state=beam_fn_api_pb2.StateKey.BagUserState(
          transform_id='t', user_state_id='s', window=b'w', key=key))


def _ordered_key() -> beam_fn_api_pb2.StateKey:
  return beam_fn_api_pb2.StateKey(
      ordered_list_user_state=beam_fn_api_pb2.StateKey.OrderedListUserState(
          transform_id='t', user_state_id='o', window=b'w', key=b'k'))


# How the SDK writes an ordered list's entries: (sort key, value bytes).
ORDERED = TupleCoder([VarIntCoder(), LengthPrefixCoder(BytesCoder())])


def test_per_task_state_starts_empty_every_time():
  backend = PerTaskState()
  first = backend.open([], journaled=False)
  first.append_raw(_bag_key(b'a'), b'1')
  backend.close(first, succeeded=True)
  second = backend.open([], journaled=False)
  assert second.get_raw(_bag_key(b'a')) == (b'', None)


def test_stored_state_carries_user_state_to_the_next_task():
  store = {}
  backend = StoredState(store)
  side = [(beam_fn_api_pb2.StateKey(
      iterable_side_input=beam_fn_api_pb2.StateKey.IterableSideInput(
          transform_id='t', side_input_id='side', window=b'w')
  ).SerializeToString(), b'side')]
  first = backend.open([side], journaled=True)
  first.append_raw(_bag_key(b'a'), b'1')
  first.append_raw(_bag_key(b'a'), b'2')
  first.append_raw(_bag_key(b'b'), b'x')
  first.append_raw(_ordered_key(), ORDERED.encode((7, b'seven')))
  backend.close(first, succeeded=True)
  # Only user state is kept: side inputs belong to the task.
  assert len(store) == 3
  second = backend.open([], journaled=True)
  assert second.get_raw(_bag_key(b'a')) == (b'12', None)
  # The ordered list's index is rebuilt from the stored entries.
  ranged = _ordered_key()
  ranged.ordered_list_user_state.range.start = 0
  ranged.ordered_list_user_state.range.end = 100
  assert second.get_raw(ranged) == (ORDERED.encode((7, b'seven')), None)
  second.clear(_bag_key(b'b'))
  backend.close(second, succeeded=True)
  assert _bag_key(b'b').SerializeToString() not in store


def test_a_failed_task_leaves_the_store_as_it_was():
  store = {}
  backend = StoredState(store)
  first = backend.open([], journaled=False)
  first.append_raw(_bag_key(b'a'), b'1')
  backend.close(first, succeeded=True)
  failed = backend.open([], journaled=False)
  failed.append_raw(_bag_key(b'a'), b'2')
  failed.clear(_bag_key(b'a'))
  backend.close(failed, succeeded=False)
  assert store == {_bag_key(b'a').SerializeToString(): [b'1']}


class _RunningCount(beam.DoFn):
  SEEN = userstate.BagStateSpec('seen', VarIntCoder())

  def process(self, kv, seen=beam.DoFn.StateParam(SEEN)):
    seen.add(kv[1])
    yield kv[0], sum(seen.read())


def test_a_stateful_stage_resumes_from_the_store_in_its_next_task():
  p = beam.Pipeline()
  _ = (p | beam.Create([('a', 1)])
       | beam.ParDo(_RunningCount()).with_output_types(tuple[str, int])
       | beam.GroupByKey())
  plan = plan_pipeline(p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default()))
  (stage,) = [s for s in plan.stages if s.stateful]
  job_id = f'state-test-{uuid.uuid4().hex[:8]}'
  runtime = JobRuntime(job_id, plan.components)
  (transform_id,) = stage.inputs
  impl = runtime.coder_impl(stage.input_coders[transform_id])

  def opaque(coder_id):
    """Whether the runner sees the KV's key and value as the SDK's bytes."""
    kv = runtime.coder(coder_id).wrapped_value_coder
    return isinstance(kv.coders()[0], beam.coders.BytesCoder)

  key_coder, int_coder = StrUtf8Coder(), VarIntCoder()

  def run(kvs, backend):
    if opaque(stage.input_coders[transform_id]):
      kvs = [(key_coder.encode(k), int_coder.encode(v)) for k, v in kvs]
    values = [WindowedValue(kv, 0, [GlobalWindow()]) for kv in kvs]
    inputs = [(transform_id, c) for c in encode_stream(impl, values)]
    out = []
    for out_id, chunk in StageRunner(job_id, runtime, stage,
                                     state_backend=backend).run(inputs):
      out_impl = runtime.coder_impl(stage.output_coders[out_id])
      decoded = [wv.value for wv in decode_all(out_impl, [chunk])]
      if opaque(stage.output_coders[out_id]):
        decoded = [(key_coder.decode(k), int_coder.decode(v))
                   for k, v in decoded]
      out.extend(decoded)
    return out

  try:
    store = {}
    assert run([('a', 1), ('b', 5)], StoredState(store)) == [('a', 1),
                                                             ('b', 5)]
    assert run([('a', 2)], StoredState(store)) == [('a', 3)]
    # Batch's per-task state would have started again from nothing.
    assert run([('a', 2)], PerTaskState()) == [('a', 2)]
  finally:
    harnesses.release_job(job_id)


# -- map and set user state (multimap_keys_user_state), as Java and Go ask --


def _map_value(map_key: bytes, user_key=b'k'):
  return beam_fn_api_pb2.StateKey(
      multimap_user_state=beam_fn_api_pb2.StateKey.MultimapUserState(
          transform_id='t', user_state_id='m', window=b'w', key=user_key,
          map_key=map_key))


def _map_keys(user_key=b'k'):
  return beam_fn_api_pb2.StateKey(
      multimap_keys_user_state=beam_fn_api_pb2.StateKey.MultimapKeysUserState(
          transform_id='t', user_state_id='m', window=b'w', key=user_key))


def test_map_state_lists_clears_and_rolls_back_its_keys():
  from beam_pyspark.worker.state import StoredState
  from beam_pyspark.worker.state import task_state
  servicer = task_state([], journaled=True)
  servicer.append_raw(_map_value(b'\x01a'), b'v1')
  servicer.append_raw(_map_value(b'\x01b'), b'v2')
  servicer.append_raw(_map_value(b'\x01a'), b'v3')
  servicer.append_raw(_map_value(b'\x01z', user_key=b'other'), b'v4')
  assert servicer.get_raw(_map_keys()) == (b'\x01a\x01b', None)
  assert servicer.get_raw(_map_value(b'\x01a')) == (b'v1v3', None)
  servicer.clear(_map_value(b'\x01a'))
  assert servicer.get_raw(_map_keys()) == (b'\x01b', None)
  # A failed bundle's writes are undone, the map's keys with them.
  servicer.begin_bundle()
  servicer.append_raw(_map_value(b'\x01c'), b'v5')
  servicer.clear(_map_keys())
  assert servicer.get_raw(_map_keys()) == (b'', None)
  assert servicer.get_raw(_map_value(b'\x01b')) == (b'', None)
  servicer.rollback_bundle()
  assert servicer.get_raw(_map_keys()) == (b'\x01b', None)
  assert servicer.get_raw(_map_value(b'\x01b')) == (b'v2', None)
  servicer.commit_bundle()
  # Kept between tasks (streaming's store): the keys come back with it.
  store = {}
  backend = StoredState(store)
  backend.close(servicer, succeeded=True)
  again = backend.open([], journaled=False)
  assert again.get_raw(_map_keys()) == (b'\x01b', None)
  assert again.get_raw(_map_keys(b'other')) == (b'\x01z', None)
  # Clearing the whole map removes every key's values.
  again.clear(_map_keys())
  assert again.get_raw(_map_value(b'\x01b')) == (b'', None)
  assert again.get_raw(_map_keys()) == (b'', None)
