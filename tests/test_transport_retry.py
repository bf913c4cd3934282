"""A bundle whose harness lost a Fn API channel runs again on a new harness.

Beam's SDK harness keeps the error of a failed state (or data) stream for
good: every later request of that harness fails with it. CI saw this once
for a stateful DoFn under LOOPBACK ("failed to connect to all addresses ...
Connection refused" on the state channel). The runner retries such a bundle
once on a fresh harness, and undoes the failed attempt's user state writes
first, so that the retry sees the state the first attempt started from.

Real parts: Beam's state servicer with real StateKeys, and a stateful stage
run by StageRunner on Beam's gRPC harness (embedded_python_grpc: an
SdkHarness in this process, over real gRPC) whose state server is stopped
before its first bundle, so that the harness's state connection is refused.
"""

import logging
import uuid

import apache_beam as beam
import pytest
from apache_beam.coders import VarIntCoder
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.transforms import environments
from apache_beam.transforms import userstate
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.worker import harness as harness_mod
from beam_pyspark.worker import remote
from beam_pyspark.worker.bundles import StageRunner
from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.state import task_state

# -- the journal of the task's state servicer ---------------------------------


def bag(user_key: bytes, state_id='bag') -> beam_fn_api_pb2.StateKey:
  return beam_fn_api_pb2.StateKey(
      bag_user_state=beam_fn_api_pb2.StateKey.BagUserState(
          transform_id='t', user_state_id=state_id, window=b'w', key=user_key))


def ordered(user_key: bytes, start=None, end=None) -> beam_fn_api_pb2.StateKey:
  key = beam_fn_api_pb2.StateKey(
      ordered_list_user_state=beam_fn_api_pb2.StateKey.OrderedListUserState(
          transform_id='t', user_state_id='ol', window=b'w', key=user_key))
  if start is not None:
    key.ordered_list_user_state.range.start = start
    key.ordered_list_user_state.range.end = end
  return key


def side_input() -> beam_fn_api_pb2.StateKey:
  return beam_fn_api_pb2.StateKey(
      iterable_side_input=beam_fn_api_pb2.StateKey.IterableSideInput(
          transform_id='t', side_input_id='side', window=b'w'))


ORDERED_CODER = beam.coders.TupleCoder(
    [VarIntCoder(), beam.coders.coders.LengthPrefixCoder(
        beam.coders.BytesCoder())]).get_impl()


def add_ordered(servicer, user_key, entries):
  servicer.append_raw(
      ordered(user_key),
      b''.join(ORDERED_CODER.encode(e) for e in entries))


def read_ordered(servicer, user_key):
  data, _ = servicer.get_raw(ordered(user_key, -(1 << 62), 1 << 62))
  return list(ORDERED_CODER.decode_all(data))


def read(servicer, key) -> bytes:
  data, token = servicer.get_raw(key)
  assert token is None
  return data


def everything(servicer) -> dict:
  keys = [bag(b'a'), bag(b'b'), bag(b'c'), bag(b'a', 'other'), side_input()]
  snapshot = {k.SerializeToString(): read(servicer, k) for k in keys}
  snapshot['ordered a'] = read_ordered(servicer, b'a')
  snapshot['ordered b'] = read_ordered(servicer, b'b')
  return snapshot


def a_task_with_state():
  servicer = task_state([[(side_input().SerializeToString(), b'side!')]])
  servicer.append_raw(bag(b'a'), b'a1')
  servicer.append_raw(bag(b'a'), b'a2')
  servicer.append_raw(bag(b'b'), b'b1')
  add_ordered(servicer, b'a', [(1, b'x'), (5, b'y')])
  return servicer


def a_bundle_of_writes(servicer):
  servicer.append_raw(bag(b'a'), b'a3')  # onto an existing bag
  servicer.clear(bag(b'b'))  # a cleared bag...
  servicer.append_raw(bag(b'b'), b'b2')  # ... written again
  servicer.append_raw(bag(b'c'), b'c1')  # a bag the task did not have
  servicer.clear(bag(b'c'))
  servicer.append_raw(bag(b'c'), b'c2')
  servicer.append_raw(bag(b'a', 'other'), b'o1')
  add_ordered(servicer, b'a', [(3, b'z'), (5, b'y2')])
  servicer.clear(ordered(b'a', 0, 2))  # removes (1, x)
  add_ordered(servicer, b'b', [(7, b'w')])


def test_a_rolled_back_bundle_leaves_the_state_it_started_from():
  servicer = a_task_with_state()
  before = everything(servicer)
  assert before[bag(b'a').SerializeToString()] == b'a1a2'
  assert before['ordered a'] == [(1, b'x'), (5, b'y')]

  servicer.begin_bundle()
  a_bundle_of_writes(servicer)
  assert everything(servicer) != before  # the bundle did write
  servicer.rollback_bundle()
  assert everything(servicer) == before

  # The same writes again, kept this time: applied exactly once.
  servicer.begin_bundle()
  a_bundle_of_writes(servicer)
  servicer.commit_bundle()
  after = everything(servicer)
  assert after[bag(b'a').SerializeToString()] == b'a1a2a3'
  assert after[bag(b'b').SerializeToString()] == b'b2'
  assert after[bag(b'c').SerializeToString()] == b'c2'
  assert after[bag(b'a', 'other').SerializeToString()] == b'o1'
  assert after[side_input().SerializeToString()] == b'side!'
  assert after['ordered a'] == [(3, b'z'), (5, b'y'), (5, b'y2')]
  assert after['ordered b'] == [(7, b'w')]

  # A later rollback goes back to the committed state, not further.
  servicer.begin_bundle()
  servicer.clear(bag(b'a'))
  servicer.clear(ordered(b'a', 0, 10))
  servicer.rollback_bundle()
  assert everything(servicer) == after


def test_writes_outside_a_bundle_journal_are_kept():
  servicer = a_task_with_state()
  servicer.append_raw(bag(b'a'), b'a3')
  servicer.rollback_bundle()  # nothing was journaled: nothing to undo
  assert read(servicer, bag(b'a')) == b'a1a2a3'


# -- a stateful stage on a harness whose state connection is refused ---------


class RunningList(beam.DoFn):
  """Emits, per element, every value its key has seen so far."""
  SEEN = userstate.BagStateSpec('seen', VarIntCoder())

  def process(self, kv, seen=beam.DoFn.StateParam(SEEN)):
    key, value = kv
    seen.add(value)
    yield key, ' '.join(str(v) for v in sorted(seen.read()))


INPUT = [('a', 1), ('b', 10), ('a', 2), ('a', 3), ('b', 20)]


class _StatefulStage:
  def __init__(self):
    p = beam.Pipeline()
    _ = (
        p | beam.Create(INPUT)
        | 'Running' >> beam.ParDo(RunningList()).with_output_types(
            tuple[str, str])
        | beam.GroupByKey())  # so that the stage has an output
    plan = plan_pipeline(
        p.to_runner_api(
            default_environment=environments.EmbeddedPythonGrpcEnvironment.
            default()))
    (self.stage, ) = [
        s for s in plan.stages
        if s.kind == 'sdk' and any('Running' in n for n in s.transform_names)
    ]
    self.job_id = f'retry-test-{uuid.uuid4().hex[:8]}'
    self.runtime = JobRuntime(self.job_id, plan.components)
    assert self.stage.stateful
    assert remote.is_remote(
        self.runtime.components.environments[self.stage.environment_id])

  def inputs(self):
    (transform_id, ) = self.stage.inputs
    impl = self.runtime.coder_impl(self.stage.input_coders[transform_id])
    values = [WindowedValue(kv, 0, [GlobalWindow()]) for kv in INPUT]
    return [(transform_id, chunk) for chunk in encode_stream(impl, values)]

  def decode(self, outputs) -> list:
    values = []
    for transform_id, chunk in outputs:
      impl = self.runtime.coder_impl(self.stage.output_coders[transform_id])
      values.extend(wv.value for wv in decode_all(impl, [chunk]))
    return values

  def harness(self) -> remote.RemoteHarness:
    return remote.harness_for(
        self.job_id, self.stage.environment_id, self.runtime.components, None,
        harness_mod.DelegatingStateHandler())


class _Warnings(logging.Handler):
  """The warnings StageRunner logs (CI runs pytest without its logging
  plugin, so no caplog)."""
  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.fixture
def bundle_warnings():
  handler = _Warnings()
  logger = logging.getLogger('beam_pyspark.worker.bundles')
  logger.addHandler(handler)
  try:
    yield handler.messages
  finally:
    logger.removeHandler(handler)


EXPECTED = [('a', '1'), ('b', '10'), ('a', '1 2'), ('a', '1 2 3'),
            ('b', '10 20')]


def test_a_stateful_bundle_whose_state_channel_is_refused_runs_again(
    bundle_warnings):
  stage = _StatefulStage()
  try:
    broken = stage.harness()
    # The harness's state connection will be refused, as in CI: Beam's
    # harness opens its state stream with the bundle, and keeps the error.
    broken.manager._grpc_server.state_server.stop(None).wait()  # pylint: disable=protected-access
    outputs = list(StageRunner(stage.job_id, stage.runtime, stage.stage).run(
        stage.inputs()))
    assert stage.decode(outputs) == EXPECTED
    retried = [m for m in bundle_warnings if 'lost its Fn API channel' in m]
    assert len(retried) == 1, bundle_warnings
    assert 'failed to connect to all addresses' in retried[0]
    # The broken harness was dropped; the task's next stage gets the new one.
    assert stage.harness() is not broken
  finally:
    remote.release_job(stage.job_id)


def test_the_same_stage_on_a_working_harness_gives_the_same_output(
    bundle_warnings):
  stage = _StatefulStage()
  try:
    outputs = list(StageRunner(stage.job_id, stage.runtime, stage.stage).run(
        stage.inputs()))
    assert stage.decode(outputs) == EXPECTED
    assert not [m for m in bundle_warnings if 'lost its Fn API channel' in m]
  finally:
    remote.release_job(stage.job_id)


# -- a failed task's Python worker stops its harnesses before it exits -------


def fail_on_three(x):
  if x == 3:
    raise ValueError('three is cursed')
  return x


def state_streams() -> set:
  """The state streams of the SDK harnesses in this process (LOOPBACK runs
  them here): Beam's harness reads each in a thread named read_state."""
  import threading
  return {t for t in threading.enumerate() if t.name == 'read_state'}


def test_a_failed_loopback_task_stops_its_harnesses_cleanly():
  """PySpark ends a Python worker whose task failed with os._exit: no atexit
  hook runs. A LOOPBACK harness whose servers vanish that way keeps its
  state stream reconnecting to the dead port, and gRPC shares that
  connection's backoff with a later harness whose server gets the same port
  (its state reads then fail: the CI failure this file is about). The
  failing task stops its harnesses first, so they end their streams."""
  import time
  from apache_beam.options.pipeline_options import PipelineOptions
  before = state_streams()
  options = PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
      '--environment_type=LOOPBACK'])
  with pytest.raises(Exception, match='three is cursed'):
    with beam.Pipeline(options=options) as p:
      _ = (p | beam.Create([1, 2, 3, 4]) | beam.Map(fail_on_three))
  deadline = time.monotonic() + 15
  while state_streams() - before and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not state_streams() - before
