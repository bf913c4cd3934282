"""What a streaming count's throughput rests on, checked without Spark
(benchmarks/streaming_throughput.py measures it): an unbounded read's
output spread over the partitions, its consumers on the fast path, and
the fast path's fixed windows equal to Beam's."""

from __future__ import annotations

import random
import time

import apache_beam as beam
from apache_beam.transforms import environments
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import PaneInfo
from apache_beam.utils.windowed_value import PaneInfoTiming
from apache_beam.utils.windowed_value import WindowedValue

from beam_pyspark.options import RunnerOptions
from beam_pyspark.planning import readbreak
from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.spark import tasks
from beam_pyspark.spark import streamreads
from beam_pyspark.worker.fastpath import outputs
from beam_pyspark.worker.runtime import JobRuntime


def _count(p):
  start = time.time()
  return (p
          | PeriodicImpulse(start_timestamp=start, stop_timestamp=start + 5,
                            fire_interval=0.01)
          | beam.Map(lambda t: (int(float(t) * 1000) % 10, 1))
          | beam.WindowInto(window.FixedWindows(1))
          | beam.CombinePerKey(sum))


def _plan(streaming: bool):
  p = beam.Pipeline()
  _count(p)
  return plan_pipeline(p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default()),
                       streaming=streaming)


def test_unbounded_read_output_is_spread_and_its_consumers_take_the_fast_path():
  plan = _plan(streaming=True)
  reads = streamreads.StreamReads(plan, RunnerOptions())
  (read, ) = [s for s in plan.stages if s.name in reads.splittable]
  (spread, ) = [s for s in plan.stages if s.kind == 'reshuffle' and
                '/Spread' in ''.join(s.transform_names)]
  # The read writes what the Reshuffle reads, and the Reshuffle moves the
  # same coder's bytes (no transcoding).
  assert list(spread.inputs.values()) == list(read.outputs.values())
  assert list(spread.input_coders.values()) == list(
      spread.output_coders.values())
  (consumer, ) = [s for s in plan.stages if s.kind == 'sdk' and set(
      s.inputs.values()) == set(spread.outputs.values())]
  assert any('WindowInto' in n for n in consumer.transform_names)
  # It deals the read's chunks whole; a user's Reshuffle deals elements.
  assert readbreak.spreads_chunks(spread.transform_names)
  assert list(tasks.SpreadElements(None, 'unused', 2, whole_chunks=True)(
      1, [b'a', b'b', b'c'])) == [(1, b'a'), (0, b'b'), (1, b'c')]
  p = beam.Pipeline()
  _ = p | beam.Create([1, 2]) | beam.Reshuffle()
  users = [s for s in plan_pipeline(p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default()),
                                     streaming=True).stages
           if s.kind == 'reshuffle']
  assert users and not any(readbreak.spreads_chunks(s.transform_names)
                           for s in users)
  chosen, note = streamreads.fast_paths(
      plan, JobRuntime('throughput-test', plan.components), reads.splittable)
  assert consumer.name in chosen, note
  assert read.name not in chosen
  # Its read hands its chunks on compact (worker.sequence.Offsets), through
  # the Spread, to the fast path; not when a harness reads them (then the
  # read encodes), nor as a side input.
  consumers = plan.consumers()
  assert streamreads.compact_output(read, consumers, chosen, set())
  assert not streamreads.compact_output(read, consumers, {}, set())
  assert not streamreads.compact_output(read, consumers, chosen,
                                        set(spread.outputs.values()))
  # A batch job's bounded reads are not moved.
  assert not any('/Spread' in ''.join(s.transform_names)
                 for s in _plan(streaming=False).stages)


def test_fixed_windows_equal_beams():
  rng = random.Random(32)
  for size, offset in [(1, 0), (60, 7), (0.5, 0.25), (3600, 0)]:
    fn = window.FixedWindows(size, offset)
    assign = outputs._assign_fixed(fn)  # pylint: disable=protected-access
    stamps = sorted(rng.randint(-10**13, 10**13) for _ in range(3000))
    stamps += [0, -1, 1, int(offset * 1e6), int(size * 1e6) - 1]
    for micros in stamps:
      t = Timestamp(micros=micros)
      m = WindowedValue('v', t, (window.GlobalWindow(), ))
      got = assign('v', m)
      want = fn.assign(window.WindowFn.AssignContext(
          t, element='v', window=window.GlobalWindow()))
      assert list(got.windows) == list(want), (size, offset, micros)
      assert (got.value, got.timestamp, got.pane_info) == ('v', t,
                                                           m.pane_info)
  # As Beam's WindowInto, a pane is not carried over.
  fired = WindowedValue('v', Timestamp(3), (window.GlobalWindow(), ),
                        PaneInfo(True, True, PaneInfoTiming.ON_TIME, 0, 0))
  out = outputs._assign_fixed(window.FixedWindows(2))('v', fired)  # pylint: disable=protected-access
  assert out.pane_info.timing == PaneInfoTiming.UNKNOWN
  assert list(out.windows) == [window.IntervalWindow(2, 4)]


def test_the_fast_paths_fixed_windows_are_beams_interval_windows():
  import pickle
  (got, ) = outputs._assign_fixed(window.FixedWindows(2))(  # pylint: disable=protected-access
      'v', WindowedValue('v', Timestamp(3), (window.GlobalWindow(), ))).windows
  beams, other = window.IntervalWindow(2, 4), window.IntervalWindow(2, 6)
  # Equal, unequal and hashing as Beam's, whichever side it is on.
  assert got == beams and beams == got and not got != beams
  assert not beams != got and got != other and other != got
  assert hash(got) == hash(beams) and {beams: 1}[got] == {got: 1}[beams]
  assert isinstance(got, window.IntervalWindow) and got < other
  assert type(pickle.loads(pickle.dumps(got))) is window.IntervalWindow  # pylint: disable=unidiomatic-typecheck


def test_grouping_state_entries_are_zlib_and_old_bz2_entries_still_read():
  from apache_beam.internal import pickler
  from beam_pyspark.worker import streaming as worker_streaming
  value = (b'key', {'window': [1, 2, 3], 'pane': 'x' * 300})
  written = worker_streaming._dump_entry(value)  # pylint: disable=protected-access
  old = pickler.dumps(value)  # what checkpoints before hold: bz2
  assert not written.startswith(worker_streaming._BZ2_ENTRY)  # pylint: disable=protected-access
  assert old.startswith(worker_streaming._BZ2_ENTRY)  # pylint: disable=protected-access
  assert worker_streaming._load_entry(written) == value  # pylint: disable=protected-access
  assert worker_streaming._load_entry(old) == value  # pylint: disable=protected-access
