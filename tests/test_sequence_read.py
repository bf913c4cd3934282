"""A streaming PeriodicImpulse read a grant at a time (worker.sequence),
held equal to Beam's ImpulseSeqGenDoFn run by Beam's in-process harness
under the same grant, no Spark: the same outputs (values, timestamps,
windows, panes), the same residual (its restriction, watermark estimator
state and size, output watermark, when it resumes, busy or not), the same
element counts. The clock is frozen for both (the DoFn reads time.time()
per offset), so both see the same offsets due."""

from __future__ import annotations

import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.io.restriction_trackers import OffsetRange
from apache_beam.metrics import monitoring_infos
from apache_beam.transforms import environments
from apache_beam.transforms import periodicsequence
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse
from apache_beam.utils import timestamp
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.spark.streamreads import StreamReads
from beam_pyspark.options import RunnerOptions
from beam_pyspark.worker import endpoints
from beam_pyspark.worker import harnesses
from beam_pyspark.worker import sequence
from beam_pyspark.worker.bundles import StageRunner
from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.runtime import JobRuntime
from apache_beam.portability.api import beam_fn_api_pb2


class _Frozen:
  """``time`` for the DoFn, Timestamp.now and the fast read: time.time()
  stands still at ``now``."""
  def __init__(self, now: float):
    self.now = now
    self.monotonic = time.monotonic
    self.sleep = time.sleep

  def time(self) -> float:
    return self.now


def _plan(data=None, windowing=False):
  p = beam.Pipeline()
  # Float times: the element's coder follows their types (int: VarInt).
  _ = (p | PeriodicImpulse(start_timestamp=0.0, stop_timestamp=1.0,
                           fire_interval=0.5, data=data,
                           apply_windowing=windowing)
       | beam.Map(lambda t: t))
  plan = plan_pipeline(p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default()),
                       streaming=True)
  (stage, ) = [s for s in plan.stages
               if s.name in StreamReads(plan, RunnerOptions()).splittable]
  return plan, stage


@pytest.fixture(scope='module')
def read_stage():
  plan, stage = _plan()
  job_id = f'sequence-{uuid.uuid4().hex[:8]}'
  runtime = JobRuntime(job_id, plan.components)
  yield job_id, runtime, stage
  harnesses.release_job(job_id)


def _element(runtime, stage, seq, offsets, estimate=None) -> bytes:
  (input_id, ) = stage.inputs
  impl = runtime.coder_impl(stage.input_coders[input_id])
  # The runner-safe coder holds the element and restriction as the SDK's
  # bytes: encode with the harness's view (the descriptor's port coder).
  descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
      stage.descriptor)
  read = sequence.SequenceRead.of(descriptor)
  assert read is not None and read.input_id == input_id
  value = ((seq, (offsets, estimate)), 8.0 * (offsets.stop - offsets.start))
  encoded = read._in.encode_nested(  # pylint: disable=protected-access
      WindowedValue(value, MIN_TIMESTAMP, (window.GlobalWindow(), )))
  assert list(decode_all(impl, [encoded]))  # the runner reads it too
  return encoded


def _run(read_stage, monkeypatch, element, grant, now, fast):
  job_id, runtime, stage = read_stage
  frozen = _Frozen(now)
  for module in (periodicsequence, timestamp, sequence):
    monkeypatch.setattr(module, 'time', frozen)
  if not fast:
    monkeypatch.setattr(sequence, 'bundle_read', lambda *_: None)
  else:  # no bundle reaches the harness
    monkeypatch.setattr(StageRunner, '_start', None)
  finished = []
  runner = StageRunner(job_id, runtime, stage,
                       limits=endpoints.Limits(None, 30.0),
                       on_finish=finished.append)
  (input_id, ) = stage.inputs
  records = list(runner.run([(endpoints.ENDPOINT_TAG, endpoints.Granted(
      'e1', input_id, element, grant))]))
  monkeypatch.undo()
  outputs, residuals = [], []
  for tag, item in records:
    if tag == endpoints.RESIDUAL_TAG:
      residuals.append(item)
    else:  # decoded as the SDK's (the runner's coder keeps its bytes)
      impl = sequence.SequenceRead.of(beam_fn_api_pb2.ProcessBundleDescriptor.
                                      FromString(stage.descriptor))._out  # pylint: disable=protected-access
      assert list(decode_all(runtime.coder_impl(stage.output_coders[tag]),
                             [item]))
      outputs.extend((wv.value, wv.timestamp, wv.windows, wv.pane_info)
                     for wv in decode_all(impl, [item]))
  counts = {
      info.labels[monitoring_infos.PCOLLECTION_LABEL]:
      monitoring_infos.extract_counter_value(info)
      for info in finished[0].monitoring_infos
      if info.urn == monitoring_infos.ELEMENT_COUNT_URN}
  return outputs, residuals, counts


def _residual(read_stage, residual):
  _, runtime, stage = read_stage
  read = sequence.SequenceRead.of(beam_fn_api_pb2.ProcessBundleDescriptor.
                                  FromString(stage.descriptor))
  (wv, ) = decode_all(read._in, [residual.element])  # pylint: disable=protected-access
  (seq, (offsets, estimate)), size = wv.value
  return {'seq': seq, 'range': (offsets.start, offsets.stop),
          'estimate': estimate, 'size': size, 'window': wv.windows,
          'watermark': residual.watermark, 'busy': residual.busy,
          'position': residual.position, 'parent': residual.parent,
          'backlog': residual.backlog, 'input': residual.input_id}


def _same(read_stage, monkeypatch, element, grant, now):
  """Both ways; their outputs and residuals, asserted equal."""
  results = {}
  for fast in (False, True):
    outputs, residuals, counts = _run(read_stage, monkeypatch, element, grant,
                                      now, fast)
    # Each asks to resume at its clock's now plus the delay asked for (the
    # harness takes its now from the real clock, the fast read from the
    # frozen one).
    clock = now if fast else time.time()
    delays = [(r.resume_at - clock * 1e6) / 1e6 for r in residuals]
    results[fast] = (outputs, [_residual(read_stage, r) for r in residuals],
                     counts, delays)
  (harness, h_res, h_counts, h_delays), (fast, f_res, f_counts, f_delays) = (
      results[False], results[True])
  assert fast == harness
  assert f_res == h_res
  _, _, stage = read_stage
  outputs_pcoll = [p for p in f_counts if f_counts[p] == len(fast)]
  assert f_counts == {k: v for k, v in h_counts.items() if k in f_counts}
  assert outputs_pcoll or not fast
  # When it resumes: now or at the next offset's time, as the DoFn asked.
  assert [round(d) for d in f_delays] == [round(d) for d in h_delays]
  return fast, f_res


def test_a_grant_of_due_offsets_then_its_residual(read_stage, monkeypatch):
  now = time.time()
  seq = (now - 100.0, now - 50.0, 0.01)  # 5000 offsets, all due
  element = _element(read_stage[1], read_stage[2], seq, OffsetRange(0, 5000))
  outputs, (residual, ) = _same(read_stage, monkeypatch, element, 1234, now)
  assert len(outputs) == 1234
  value, ts, windows, _ = outputs[-1]
  # Its value is its time; its timestamp the same (in milliseconds between
  # stages, as Beam's windowed value coder has them).
  exact = Timestamp.of(value)
  assert value == seq[0] + seq[2] * 1233
  assert ts == Timestamp(micros=exact.micros // 1000 * 1000)
  assert windows == [window.GlobalWindow()] or windows == (
      window.GlobalWindow(), )
  # Busy: the grant ran out before the due offsets did; resumes at once.
  assert residual['range'] == (1234, 5000) and residual['busy']
  assert residual['watermark'] == exact.micros == residual['estimate'].micros
  # Its residual carries on where it stopped, its watermark state with it;
  # a grant past the range's end reads it to the end, leaving nothing.
  rest = _element(read_stage[1], read_stage[2], seq, OffsetRange(1234, 5000),
                  residual['estimate'])
  outputs, residuals = _same(read_stage, monkeypatch, rest, 10_000, now)
  assert len(outputs) == 5000 - 1234 and not residuals


def test_offsets_not_due_yet_wait_for_their_time(read_stage, monkeypatch):
  now = time.time()
  seq = (now - 2.0, now + 100.0, 0.001)
  element = _element(read_stage[1], read_stage[2], seq, OffsetRange(0, 102000))
  outputs, (residual, ) = _same(read_stage, monkeypatch, element, 100_000, now)
  due = len(outputs)
  assert 1990 <= due <= 2010
  # Not busy: it read all that was due; the watermark at the next offset.
  assert residual['range'] == (due, 102000) and not residual['busy']
  assert residual['watermark'] == Timestamp(seq[0] + seq[2] * due).micros
  # A grant of exactly the offsets due: busy, and yet deferred to the next.
  outputs, (residual, ) = _same(read_stage, monkeypatch, element, due, now)
  assert len(outputs) == due and residual['busy']
  # Nothing due: no output; it waits for its first offset's time.
  later = (now + 10.0, now + 20.0, 0.5)
  element = _element(read_stage[1], read_stage[2], later, OffsetRange(0, 20))
  outputs, (residual, ) = _same(read_stage, monkeypatch, element, 5, now)
  assert not outputs and residual['range'] == (0, 20)
  assert residual['watermark'] == Timestamp(now + 10.0).micros


def test_the_time_limit_checkpoints_between_chunks(read_stage):
  _, runtime, stage = read_stage
  now = time.time()
  seq = (now - 1000.0, now - 1.0, 0.001)  # about 999,000 due
  element = _element(runtime, stage, seq, OffsetRange(0, 999_000))
  read = sequence.SequenceRead.of(beam_fn_api_pb2.ProcessBundleDescriptor.
                                  FromString(stage.descriptor))
  records = list(read.read(element, endpoints.Limits(None, 0.0), 'e7'))
  (tag, residual), = records[1:]
  # One chunk, then the runner's checkpoint: not busy, resumes at once.
  assert tag == endpoints.RESIDUAL_TAG and not residual.busy
  assert residual.parent == 'e7' and residual.position == repr(
      sequence.CHUNK - 1)
  assert residual.resume_at <= time.time() * 1e6
  assert residual.watermark == Timestamp.of(
      seq[0] + seq[2] * (sequence.CHUNK - 1)).micros


def test_only_the_dofn_alone_without_data_in_the_global_window():
  for data, windowing in [([1, 2, 3], False), (None, True)]:
    _, stage = _plan(data, windowing)
    descriptor = beam_fn_api_pb2.ProcessBundleDescriptor.FromString(
        stage.descriptor)
    # With data its values are not its timestamps; apply_windowing is fused
    # after the read (its own stage's input is still global).
    found = sequence.SequenceRead.of(descriptor)
    assert (found is None) == (data is not None), (data, windowing)


def test_compact_chunks_are_the_elements_their_bytes_hold(read_stage,
                                                          monkeypatch):
  """A read told its consumers take compact chunks (``Limits.compact``)
  outputs ``Offsets``: encoded with the output coder they are the bytes it
  outputs otherwise, byte for byte; their elements are what those bytes
  decode to; they survive pickling (Spark moves them); and a stage run by
  the harness that is handed them reads their bytes (StageRunner)."""
  import pickle
  _, runtime, stage = read_stage
  now = time.time()
  seq = (now - 100.0, now - 1.0, 0.001)  # 99,000 due: chunks of 8,192
  element = _element(runtime, stage, seq, OffsetRange(0, 99_000))
  read = sequence.SequenceRead.of(beam_fn_api_pb2.ProcessBundleDescriptor.
                                  FromString(stage.descriptor))
  frozen = _Frozen(now)
  monkeypatch.setattr(sequence, 'time', frozen)
  got = {}
  for compact in (False, True):
    got[compact] = list(read.read(
        element, endpoints.Limits(20_000, 30.0, compact=compact), 'e1'))
  monkeypatch.undo()
  plain, compact = got[False], got[True]
  assert [t for t, _ in plain] == [t for t, _ in compact]
  assert vars(plain[-1][1]) == vars(compact[-1][1])  # the same residual
  chunks = [c for t, c in compact if t != endpoints.RESIDUAL_TAG]
  assert len(chunks) == 3 and all(
      type(c) is sequence.Offsets for c in chunks)  # pylint: disable=unidiomatic-typecheck
  impl = read._out  # pylint: disable=protected-access
  for (_, data), chunk in zip(plain, chunks):
    assert chunk.encode(impl) == data and len(chunk) == len(data)
    assert list(chunk.elements()) == list(decode_all(impl, [data]))
    again = pickle.loads(pickle.dumps(chunk))
    assert again.encode(impl) == data
  # The stage reading the read's output, run by Beam's harness on compact
  # chunks and on their bytes: the same output.
  p = beam.Pipeline()
  _ = (p | PeriodicImpulse(start_timestamp=0.0, stop_timestamp=1.0,
                           fire_interval=0.5)
       | beam.Map(lambda t: (int(t) % 3, t))
       | beam.WindowInto(window.FixedWindows(1)) | beam.GroupByKey())
  plan = plan_pipeline(p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default()),
                       streaming=True)
  (consumer, ) = [s for s in plan.stages if s.kind == 'sdk' and any(
      'Map(<lambda at test_sequence' in name for name in s.transform_names)]
  (input_id, ) = consumer.inputs
  job_id = f'sequence-{uuid.uuid4().hex[:8]}'
  runtime = JobRuntime(job_id, plan.components)
  outputs = {}
  try:
    for records in ([(input_id, c) for c in chunks],
                    [(input_id, d) for t, d in plain
                     if t != endpoints.RESIDUAL_TAG]):
      runner = StageRunner(job_id, runtime, consumer)
      outputs[type(records[0][1])] = [
          wv.value for tag, data in runner.run(records)
          for wv in decode_all(
              runtime.coder_impl(consumer.output_coders[tag]), [data])]
  finally:
    harnesses.release_job(job_id)
  assert len(outputs[bytes]) == 20_000
  assert outputs[sequence.Offsets] == outputs[bytes]
