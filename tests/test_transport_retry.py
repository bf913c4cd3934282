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

import contextlib
import logging
import time
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
from beam_pyspark.worker import harnesses
from beam_pyspark.worker.harnesses.remote import RemoteHarness
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
  servicer = task_state([[(side_input().SerializeToString(), b'side!')]],
                        journaled=True)
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


STR = beam.coders.StrUtf8Coder()
INT = VarIntCoder()
INPUT = [('a', 1), ('b', 10), ('a', 2), ('a', 3), ('b', 20)]


class _StatefulStage:
  def __init__(self, environment=None):
    p = beam.Pipeline()
    _ = (
        p | beam.Create(INPUT).with_output_types(tuple[str, int])
        | 'Running' >> beam.ParDo(RunningList()).with_output_types(
            tuple[str, str])
        | beam.GroupByKey())  # so that the stage has an output
    plan = plan_pipeline(
        p.to_runner_api(
            default_environment=environment or
            environments.EmbeddedPythonGrpcEnvironment.default()))
    (self.stage, ) = [
        s for s in plan.stages
        if s.kind == 'sdk' and any('Running' in n for n in s.transform_names)
    ]
    self.job_id = f'retry-test-{uuid.uuid4().hex[:8]}'
    self.runtime = JobRuntime(self.job_id, plan.components)
    assert self.stage.stateful
    assert harnesses.kind_for(
        self.runtime.components.environments[self.stage.environment_id]
    ) is harnesses.REMOTE

  def _opaque(self, coder_id) -> bool:
    """Whether the runner sees this KV's key and value as the SDK's bytes
    (a harness that is not Python, as far as the runner knows)."""
    kv = self.runtime.coder(coder_id).wrapped_value_coder
    return isinstance(kv.coders()[0], beam.coders.BytesCoder)

  def inputs(self):
    (transform_id, ) = self.stage.inputs
    coder_id = self.stage.input_coders[transform_id]
    kvs = INPUT
    if self._opaque(coder_id):
      kvs = [(STR.encode(k), INT.encode(v)) for k, v in INPUT]
    impl = self.runtime.coder_impl(coder_id)
    values = [WindowedValue(kv, 0, [GlobalWindow()]) for kv in kvs]
    return [(transform_id, chunk) for chunk in encode_stream(impl, values)]

  def decode(self, outputs) -> list:
    values = []
    for transform_id, chunk in outputs:
      coder_id = self.stage.output_coders[transform_id]
      impl = self.runtime.coder_impl(coder_id)
      kvs = [wv.value for wv in decode_all(impl, [chunk])]
      if self._opaque(coder_id):
        kvs = [(STR.decode(k), STR.decode(v)) for k, v in kvs]
      values.extend(kvs)
    return values

  def harness(self) -> RemoteHarness:
    return harnesses.acquire(self.job_id, self.stage, self.runtime.components,
                             None)


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
    retried = [m for m in bundle_warnings if 'lost its harness or Fn API channel' in m]
    assert len(retried) == 1, bundle_warnings
    assert 'failed to connect to all addresses' in retried[0]
    # The broken harness was dropped; the task's next stage gets the new one.
    assert stage.harness() is not broken
  finally:
    harnesses.release_job(stage.job_id)


def test_the_same_stage_on_a_working_harness_gives_the_same_output(
    bundle_warnings):
  stage = _StatefulStage()
  try:
    outputs = list(StageRunner(stage.job_id, stage.runtime, stage.stage).run(
        stage.inputs()))
    assert stage.decode(outputs) == EXPECTED
    assert not [m for m in bundle_warnings if 'lost its harness or Fn API channel' in m]
  finally:
    harnesses.release_job(stage.job_id)


# -- harnesses are stopped before their Python worker goes ---------------------
#
# How a harness gets a channel that fails at once (reproduced with plain
# gRPC): when its servers vanish with the process, the harness's open state
# stream is retried by gRPC (Beam's retry policy for UNAVAILABLE), each
# attempt a refused connection, and that connection's backoff is shared, in
# gRPC's process-wide subchannel pool, by any later channel to the same
# address: a later harness of this process (LOOPBACK runs them all here)
# whose server was given the freed port fails its state stream at once, and
# Beam keeps that error. A harness stopped before its servers go ends its
# streams cleanly, and nothing retries.


def fail_on_three(x):
  if x == 3:
    raise ValueError('three is cursed')
  return x


def state_streams() -> set:
  """The state streams of the SDK harnesses in this process (LOOPBACK runs
  them here): Beam's harness reads each in a thread named read_state."""
  import threading
  return {t for t in threading.enumerate() if t.name == 'read_state'}


@contextlib.contextmanager
def failed_state_streams():
  """Collects the errors state streams of this process end with."""
  import threading
  errors = []
  saved = threading.excepthook

  def hook(args):
    if args.thread is not None and args.thread.name == 'read_state':
      errors.append(args.exc_value)
    else:
      saved(args)

  threading.excepthook = hook
  try:
    yield errors
  finally:
    threading.excepthook = saved


def wait_until_ended(streams: set, timeout: float = 15.0) -> set:
  deadline = time.monotonic() + timeout
  while streams & state_streams() and time.monotonic() < deadline:
    time.sleep(0.1)
  return streams & state_streams()


def test_a_failed_loopback_task_stops_its_harnesses_cleanly():
  """PySpark ends the Python worker of a failed task, with os._exit (no
  atexit hook). The task stops its harnesses first."""
  from apache_beam.options.pipeline_options import PipelineOptions
  before = state_streams()
  options = PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
      '--environment_type=LOOPBACK'])
  with failed_state_streams() as errors:
    # One stage, one task: the only harness this job starts is the failing
    # task's (a harness of a task that succeeded may stay up, idle, until
    # its job's release tasks reach its Python worker).
    with pytest.raises(Exception, match='three is cursed'):
      with beam.Pipeline(options=options) as p:
        _ = (
            p | beam.Impulse() | beam.FlatMap(lambda _: [1, 2, 3, 4])
            | beam.Map(fail_on_three))
    streams = state_streams() - before
    assert not wait_until_ended(streams)
  assert not errors


def test_a_hung_up_python_worker_stops_its_harnesses_cleanly():
  """When Spark stops, PySpark's daemon ends its Python workers with SIGHUP,
  whose default action ends the process at once. A Python worker with
  harnesses stops them first. Here the Python worker is this file run as a
  script: it runs a stateful stage on a harness of a worker pool in this
  process (as LOOPBACK's are), then waits for SIGHUP."""
  import signal
  import subprocess
  import sys
  from apache_beam.runners.worker import worker_pool_main
  address, pool = worker_pool_main.BeamFnExternalWorkerPoolServicer.start()
  before = state_streams()
  worker = subprocess.Popen(
      [sys.executable, __file__, address], stdout=subprocess.PIPE, text=True)
  try:
    with failed_state_streams() as errors:
      assert worker.stdout.readline().strip() == 'ran the stage', worker.wait()
      streams = state_streams() - before
      assert streams  # the harness of the stage, alive and idle
      worker.send_signal(signal.SIGHUP)
      # It still dies of the signal, as PySpark expects...
      assert worker.wait(timeout=30) == -signal.SIGHUP
      # ... and its harness in this process ended its stream cleanly.
      assert not wait_until_ended(streams)
    assert not errors
  finally:
    if worker.poll() is None:
      worker.kill()
    pool.stop(None)


# -- each harness's servers under a loopback address of their own -----------


def test_each_harness_serves_under_a_loopback_address_of_its_own():
  """gRPC shares one connection, and its reconnect backoff, between the
  channels of a process to the same address: a harness left with streams
  to servers that went away (a killed Python worker) keeps them failing,
  and a later harness of the same process (LOOPBACK's client) whose server
  got one of those ports shared the failure. Under an address of its own
  (127.x.y.z), a server's port is a new address even when reused."""
  stage = _StatefulStage()
  hosts = []
  try:
    for _ in range(2):
      harness = stage.harness()
      url = harness.handler.state_api_service_descriptor().url
      assert url.startswith('127.') and not url.startswith('127.0.0.1:')
      hosts.append(url.rsplit(':', 1)[0])
      # The harness reaches its servers there: the stage runs.
      outputs = list(StageRunner(stage.job_id, stage.runtime, stage.stage).run(
          stage.inputs()))
      assert stage.decode(outputs) == EXPECTED
      harnesses.discard(stage.job_id, stage.stage, stage.runtime.components)
    assert hosts[0] != hosts[1]
  finally:
    harnesses.release_job(stage.job_id)


if __name__ == '__main__':
  # A Python worker for the test above: the stage's harness is started by
  # the worker pool at sys.argv[1].
  import signal
  import sys
  # As PySpark's daemon sets up each Python worker it forks (a suite run
  # under nohup, or in the background, hands its children SIGHUP ignored).
  signal.signal(signal.SIGHUP, signal.SIG_DFL)
  external = environments.ExternalEnvironment(sys.argv[1])
  stage = _StatefulStage(external)
  outputs = list(StageRunner(stage.job_id, stage.runtime, stage.stage).run(
      stage.inputs()))
  assert stage.decode(outputs) == EXPECTED
  print('ran the stage', flush=True)
  time.sleep(120)
