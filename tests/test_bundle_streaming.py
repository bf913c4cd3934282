"""A bundle's output streams out of the in-process harness as it is written.

The in-process harness runs a bundle in a thread of its own and hands its
output to the task through a bounded queue, so a DoFn that fans one element
out into more data than the Python worker can hold still runs.  These tests
use real parts: bundles of planned pipelines run by StageRunner on a real
EmbeddedHarness in this process, and whole pipelines on local[2].
"""

import threading
import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.common import ENCODED_IMPULSE_VALUE
from apache_beam.runners.runner import PipelineState
from apache_beam.transforms import environments

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.worker import harnesses
from beam_pyspark.worker.harnesses import embedded
from beam_pyspark.worker.bundles import StageRunner
from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.runtime import JobRuntime

MIB = 1 << 20
PAYLOAD = b'\x01' * MIB
# How long the waiting DoFn below waits for the runner to read its output
# before it gives up: the old harness, which returned a bundle's output
# only once the bundle had finished, fails the test after this long.
WAIT_SECS = 20.0

# Set by the test once it has received the first output chunk; a DoFn of
# this process (the in-process harness) waits on it.
RELEASE = threading.Event()


def bundle_threads() -> list[str]:
  return [
      t.name for t in threading.enumerate()
      if t.name.startswith(embedded.BUNDLE_THREAD_PREFIX)
  ]


def wait_for_no_bundle_threads(timeout: float = 10.0) -> list[str]:
  deadline = time.monotonic() + timeout
  while bundle_threads() and time.monotonic() < deadline:
    time.sleep(0.05)
  return bundle_threads()


# -- in-process: StageRunner over a real EmbeddedHarness ---------------------


def emit_then_wait(_):
  """40 MiB of output (a few of the harness's ~10 MB chunks), then waits."""
  for i in range(40):
    yield i % 3, PAYLOAD
  if not RELEASE.wait(WAIT_SECS):
    raise RuntimeError(
        f'no output of this bundle was read within {WAIT_SECS} s while it ran')
  yield 99, b'last'


def emit_endlessly(_):
  for i in range(2000):  # bounded, so that a broken abort cannot run forever
    yield i % 3, PAYLOAD


def emit_then_fail(_):
  for i in range(30):
    yield i % 3, PAYLOAD
  fail_mid_stream(30)


def fail_mid_stream(n):
  raise ValueError(f'cursed after {n} MiB of output')


class _Stage:
  """The stage of a planned Impulse | FlatMap(fn) | GroupByKey pipeline that
  runs ``fn``, with a StageRunner for it on this process's harness cache."""
  def __init__(self, fn, label='Explode'):
    p = beam.Pipeline()
    _ = (p | beam.Impulse() | label >> beam.FlatMap(fn) | beam.GroupByKey())
    plan = plan_pipeline(p.to_runner_api(
        default_environment=environments.EmbeddedPythonEnvironment.default()))
    (self.stage, ) = [
        s for s in plan.stages
        if s.kind == 'sdk' and any(label in n for n in s.transform_names)
    ]
    self.job_id = f'streaming-test-{uuid.uuid4().hex[:8]}'
    self.runtime = JobRuntime(self.job_id, plan.components)
    self.inputs = [(t, ENCODED_IMPULSE_VALUE)
                   for t, b in self.stage.inputs.items() if b == IMPULSE_BUFFER]
    assert self.inputs

  def runner(self) -> StageRunner:
    return StageRunner(self.job_id, self.runtime, self.stage)

  def decode(self, outputs) -> list:
    values = []
    for transform_id, chunk in outputs:
      impl = self.runtime.coder_impl(self.stage.output_coders[transform_id])
      values.extend(wv.value for wv in decode_all(impl, [chunk]))
    return values

  def cached_harness(self):
    return harnesses.cached(self.job_id, self.stage, self.runtime.components)

  def acquire(self):
    return harnesses.acquire(self.job_id, self.stage, self.runtime.components,
                             None)

  def release(self):
    harnesses.release_job(self.job_id)


def test_output_reaches_the_task_while_the_bundle_runs():
  stage = _Stage(emit_then_wait)
  RELEASE.clear()
  try:
    outputs = stage.runner().run(stage.inputs)
    started = time.monotonic()
    first = next(outputs)
    waited = time.monotonic() - started
    RELEASE.set()
    rest = list(outputs)
  finally:
    RELEASE.set()
    stage.release()
  assert waited < WAIT_SECS / 2
  values = stage.decode([first] + rest)
  # The stage's output coder is the runner-safe one: values are the user
  # coder's bytes, a few bytes longer than the payload.
  assert len(values) == 41
  assert sum(1 for _, v in values if MIB <= len(v) < MIB + 16) == 40
  # Chunks of about the harness's flush size, not one per element or one
  # per bundle.
  assert 2 <= len(rest) + 1 <= 10
  assert wait_for_no_bundle_threads() == []


def test_a_consumer_that_stops_early_aborts_the_bundle():
  stage = _Stage(emit_endlessly)
  try:
    outputs = stage.runner().run(stage.inputs)
    next(outputs)
    harness = stage.cached_harness()
    assert harness is not None
    assert bundle_threads()
    outputs.close()
    # The harness thread, blocked on the full queue, gives up...
    assert wait_for_no_bundle_threads() == []
    # ... and the harness that ran the aborted bundle is not reused.
    assert harness.abandoned
    again = stage.acquire()
    assert again is not harness
    assert stage.cached_harness() is again
  finally:
    stage.release()


def test_user_error_mid_stream_fails_the_stage_with_its_traceback():
  stage = _Stage(emit_then_fail, label='FailingExplode')
  received = []
  try:
    with pytest.raises(PipelineExecutionError) as raised:
      for record in stage.runner().run(stage.inputs):
        received.append(record)
  finally:
    stage.release()
  message = str(raised.value)
  assert 'cursed after 30 MiB of output' in message
  assert 'fail_mid_stream' in message  # the user's frames
  assert 'emit_then_fail' in message
  assert 'FailingExplode' in message  # the step
  assert 'Traceback' in message
  # Output written before the error was streamed (and is discarded with the
  # failed task by Spark).
  assert received
  assert stage.cached_harness() is None
  assert wait_for_no_bundle_threads() == []


def test_bundle_threads_end_with_their_bundles():
  stage = _Stage(lambda _: [(1, b'a'), (2, b'b')])
  try:
    for _ in range(3):
      out = list(stage.runner().run(stage.inputs))
      assert len(stage.decode(out)) == 2
      assert bundle_threads() == []
  finally:
    stage.release()


def test_idle_harnesses_are_evicted(monkeypatch):
  old = _Stage(lambda _: [(1, b'a')], label='Old')
  new = _Stage(lambda _: [(1, b'a')], label='New')
  try:
    list(old.runner().run(old.inputs))
    idle = old.cached_harness()
    assert idle is not None
    # Not idle long enough yet: kept.
    new.acquire()
    assert old.cached_harness() is idle
    monkeypatch.setattr(harnesses, 'IDLE_SECS', 0.2)
    time.sleep(0.3)
    new.acquire()
    assert old.cached_harness() is None
    assert new.cached_harness() is not None
  finally:
    old.release()
    new.release()


def test_a_harness_in_use_is_not_evicted(monkeypatch):
  busy = _Stage(emit_then_wait, label='Busy')
  other = _Stage(lambda _: [(1, b'a')], label='Other')
  monkeypatch.setattr(harnesses, 'IDLE_SECS', 0.0)
  RELEASE.clear()
  try:
    outputs = busy.runner().run(busy.inputs)
    first = next(outputs)
    harness = busy.cached_harness()
    time.sleep(0.1)
    other.acquire()
    assert busy.cached_harness() is harness
    RELEASE.set()
    assert len(busy.decode([first] + list(outputs))) == 41
  finally:
    RELEASE.set()
    busy.release()
    other.release()


# -- whole pipelines on local[2] ---------------------------------------------

OPTIONS = ['--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]']
EXPLODE_MIB = 600
# The most the Python worker's resident memory may grow while the FlatMap
# below emits EXPLODE_MIB: a few of the harness's 10 MB chunks in the queue,
# the chunk being written and read, and what the task's consumers buffer.
MAX_GROWTH_MIB = 256


def _status_kib(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1])
  raise KeyError(field)


class ExplodeAndMeasure(beam.DoFn):
  """One element -> n elements of 1 MiB each; then, as a tagged output, how
  far this Python worker's resident memory grew while they were emitted
  (VmHWM, reset when the element arrives: the exact peak, not a sample).

  When the last element has been emitted, the harness has written all of
  them to its data channel: a harness that holds the bundle's output until
  the bundle ends holds all n MiB at that point.
  """
  def process(self, n):
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')  # reset the peak resident set size to the current one
    base = _status_kib('VmRSS')
    for i in range(n):
      yield i, PAYLOAD
    grew = _status_kib('VmHWM') - base
    yield beam.pvalue.TaggedOutput('peak', grew // 1024)


def test_a_huge_fan_out_runs_in_bounded_memory(collect):
  def build(p):
    out = (
        p | beam.Create([EXPLODE_MIB])
        | beam.ParDo(ExplodeAndMeasure()).with_outputs('peak', main='main'))
    sums = (
        out.main | beam.GroupByKey()
        | beam.Map(lambda kv: (1, sum(len(v) for v in kv[1])))
        | beam.CombineGlobally(
            lambda pairs: tuple(map(sum, zip(*pairs))) or (0, 0))
        | beam.Map(lambda s: ('sums', s)))
    peaks = out.peak | beam.Map(lambda mib: ('peak_growth_mib', mib))
    return (sums, peaks) | beam.Flatten()

  result = dict(collect.spark(build))
  print(f'Python worker grew by {result["peak_growth_mib"]} MiB while '
        f'{EXPLODE_MIB} MiB were emitted')
  assert result['sums'] == (EXPLODE_MIB, EXPLODE_MIB * MIB)
  assert result['peak_growth_mib'] < MAX_GROWTH_MIB, result


def test_user_error_mid_stream_fails_the_pipeline():
  p = beam.Pipeline(options=PipelineOptions(OPTIONS))
  _ = (
      p | beam.Create([0])
      | 'ExplodeThenFail' >> beam.FlatMap(emit_then_fail)
      | beam.GroupByKey())
  result = p.run()
  with pytest.raises(Exception) as raised:
    result.wait_until_finish()
  message = str(raised.value)
  assert 'cursed after 30 MiB of output' in message
  assert 'fail_mid_stream' in message
  assert 'ExplodeThenFail' in message
  assert 'ValueError' in message
  assert result.state == PipelineState.FAILED
