"""Inside executors: the keyed work of one streaming wave, with its state.

A streaming job runs the plan in *waves* (``spark.streaming``): each wave
hands every stage what its producers wrote in that wave, at the clocks
the driver computed before it. Keyed work keeps state between waves, per (node,
partition), as a chain of files under the job's checkpoint location
(``worker.statestore``) whose names the driver holds and hands back:

- a GroupByKey's reduce side runs Beam's trigger driver per key
  (``streaming.grouping.KeyedGrouper``) over the partition's records;
- a stateful stage's user state (``worker.state.StoredState``) and pending
  timers (``streaming.timers.TimerTable``) are loaded, the stage runs with
  only the timers due at the wave's clocks firing, and both are saved.

Each task reports a ``PartitionReport``: its new chain, the earliest output
hold it keeps (elements a trigger has not emitted, a timer's output
timestamp), and when its next timers are due, which is how the driver
knows which stages a later wave must run.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable
from typing import Iterator
from typing import Optional

from apache_beam.internal import pickler
from apache_beam.transforms import window as beam_window
from apache_beam.utils.timestamp import Timestamp

from beam_pyspark.planning.plan import GroupSpec
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.planning.sdks import python_knows_coder
from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming.grouping import KeyedGrouper
from beam_pyspark.streaming.timers import EVENT_TIME
from beam_pyspark.streaming.timers import PROCESSING_TIME
from beam_pyspark.streaming.timers import TimerTable
from beam_pyspark.worker import elements
from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.endpoints import RESIDUAL_TAG
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.runtime import JobRuntime
from beam_pyspark.worker.shuffle import unpack_records
from beam_pyspark.worker.statestore import PartitionStore

# Records of a streaming task that carry its PartitionReport, next to its
# data records: (REPORT_TAG, PartitionReport).
REPORT_TAG = '\x00report'


def is_control(record) -> bool:
  """A task's report, held-back element or residual restriction (for the
  driver), not data."""
  return type(record) is tuple and record[0] in _CONTROL_TAGS


def is_data(record) -> bool:
  return not is_control(record)


@dataclasses.dataclass(frozen=True)
class Clocks:
  """The times a wave runs at, in microseconds: the node's input and output
  watermarks before the wave, when its new elements arrived, and the
  processing time its timers are due at."""
  input_watermark: int
  output_watermark: int
  arrival_time: int
  processing_time: int


@dataclasses.dataclass(frozen=True)
class PartitionReport:
  node: str
  partition: int
  state: Optional[tuple]  # the partition's new chain (None: no state)
  hold: Optional[int]  # earliest output hold (micros), None for none
  next_event: Optional[int]  # watermark at which a timer is next due
  next_processing: Optional[int]  # processing time a timer is next due


def _micros(ts: Optional[Timestamp]) -> Optional[int]:
  return None if ts is None else Timestamp.of(ts).micros


def _finite(ts: Optional[Timestamp]) -> Optional[int]:
  """A hold as micros; None for no hold (None or +inf)."""
  micros = _micros(ts)
  return None if micros is None or micros >= MAX_MICROS else micros


# -- GroupByKey ---------------------------------------------------------------


# Beam's pickler.dumps compresses with bz2 at level 9 unless told zlib: for
# an entry of a few hundred bytes bz2 sets up its 900 kB blocks each time
# (bz2.compress was ~5% of a 100,000 events/s count's worker CPU, on the
# state stage's critical path). Entries written before are bz2: base64 of
# bz2's 'BZh' magic.
_BZ2_ENTRY = b'Qlpo'


def _dump_entry(value) -> bytes:
  return pickler.dumps(value, use_zlib=True)


def _load_entry(entry: bytes):
  return pickler.loads(entry, use_zlib=not entry.startswith(_BZ2_ENTRY))


def group_stream(runtime: JobRuntime, spec: GroupSpec, node: str,
                 partition: int, chunks: Iterable[bytes],
                 store: PartitionStore, clocks: Clocks) -> Iterator:
  """The reduce side of a streaming GroupByKey over one partition's
  shuffled records: yields encoded output chunks, then
  (REPORT_TAG, PartitionReport). The state's entries: per key, its
  (key, trigger state) pickled; a wave rewrites the keys it touched."""
  in_impl = runtime.coder_impl(spec.input_coder_id)
  out_impl = runtime.coder_impl(spec.output_coder_id)
  grouper = KeyedGrouper(runtime.windowing(spec.windowing_strategy_id, spec.opaque_windows))
  entries, decoded = store.load()
  if decoded is None:
    keys: dict[bytes, object] = {}
    plain = {}
    for key_bytes, entry in entries.items():
      keys[key_bytes], plain[key_bytes] = _load_entry(entry)
    grouper.restore(plain)
  else:
    states, keys = decoded
    grouper.adopt(states)
  by_key: dict[bytes, list] = collections.defaultdict(list)
  for key_bytes, encoded in unpack_records(chunks):
    wv = next(decode_all(in_impl, [encoded]))
    keys.setdefault(key_bytes, wv.value[0])
    by_key[key_bytes].append(wv.with_value(wv.value[1]))
  input_wm = Timestamp(micros=clocks.input_watermark)
  output_wm = Timestamp(micros=clocks.output_watermark)
  panes = []
  arrival = Timestamp(micros=clocks.arrival_time)
  for key_bytes, values in by_key.items():
    for bundle in ([[v] for v in values] if spec.fires_per_element
                   else [values]):
      panes.extend(grouper.process(key_bytes, bundle, input_wm, output_wm,
                                   arrival))
  panes.extend(
      grouper.advance(input_wm, Timestamp(micros=clocks.processing_time)))
  yield from encode_stream(
      out_impl, (pane.with_value((keys[pane.value[0]], pane.value[1]))
                 for pane in panes))
  live = grouper.keys()
  touched = grouper.touched
  snapshot = grouper.snapshot(k for k in touched if k in live)
  for key_bytes in touched:
    if key_bytes in live:
      entries[key_bytes] = _dump_entry((keys[key_bytes], snapshot[key_bytes]))
    else:
      entries.pop(key_bytes, None)
      keys.pop(key_bytes, None)
  chain = store.save(entries, (grouper.states(), keys))
  yield REPORT_TAG, PartitionReport(
      node, partition, chain, _finite(grouper.hold()),
      _micros(grouper.next_event_time()),
      _micros(grouper.next_processing_time()))


# -- stateful stages ----------------------------------------------------------


@dataclasses.dataclass
class StageState:
  """A stateful stage's partition between waves: user state (serialized
  StateKey -> encoded chunks) and pending timers."""
  store: dict
  timers: TimerTable


# A stateful stage's entries: ('s', state key) -> its encoded chunks, and
# ('t', timer family, encoded timer) -> True for each pending timer.
_STATE, _TIMER = 's', 't'


def load_stage_state(runtime: JobRuntime, stage: StagePlan,
                     store: PartitionStore) -> StageState:
  entries, decoded = store.load()
  if decoded is not None:
    return decoded
  table = TimerTable(
      {(t.transform_id, t.family_id): t.time_domain for t in stage.timers})
  impls = _timer_impls(runtime, stage)
  user_state = {}
  for entry, value in entries.items():
    if entry[0] == _STATE:
      user_state[entry[1]] = value
    else:
      family = entry[1]
      table.written(*family, decode_all(impls[family], [entry[2]]))
  return StageState(user_state, table)


def save_stage_state(runtime: JobRuntime, stage: StagePlan, node: str,
                     partition: int, state: StageState,
                     store: PartitionStore) -> PartitionReport:
  impls = _timer_impls(runtime, stage)
  entries = {(_STATE, key): value for key, value in state.store.items()}
  for family, timer in state.timers.pending():
    encoded = b''.join(encode_stream(impls[family], [timer]))
    entries[(_TIMER, family, encoded)] = True
  chain = store.save(entries, state)
  table = state.timers
  return PartitionReport(
      node, partition, chain, _finite(table.hold()),
      _micros(table.next_fire(EVENT_TIME)),
      _micros(table.next_fire(PROCESSING_TIME)))


def _timer_impls(runtime: JobRuntime, stage: StagePlan) -> dict:
  return {(t.transform_id, t.family_id): runtime.coder_impl(t.coder_id)
          for t in stage.timers}


# -- side inputs -----------------------------------------------------------------

# Records of a streaming task that carry a main-input element held back
# until its side inputs are ready: (HELD_TAG, (input id, encoded element,
# timestamp micros)).
HELD_TAG = '\x00held'
_CONTROL_TAGS = (REPORT_TAG, HELD_TAG, RESIDUAL_TAG)


def side_input_gate(runtime: JobRuntime, stage: StagePlan, descriptor,
                    side_watermarks: dict):
  """A function telling whether a main-input element may run: for each of
  its windows and each side input, the side input's watermark has reached
  the end of the side window the main window maps onto, as Beam's
  DirectRunner decides (its executor blocks until then).

  ``side_watermarks``: (transform id, side input tag) -> micros.
  """
  from apache_beam.portability import python_urns
  from apache_beam.portability.api import beam_runner_api_pb2
  from apache_beam.transforms import sideinputs
  from apache_beam.utils import proto_utils
  gates = []
  for spec in stage.side_inputs:
    payload = proto_utils.parse_Bytes(
        descriptor.transforms[spec.transform_id].spec.payload,
        beam_runner_api_pb2.ParDoPayload)
    mapping = payload.side_inputs[spec.tag].window_mapping_fn
    if mapping.urn == python_urns.PICKLED_WINDOW_MAPPING_FN:
      fn = pickler.loads(mapping.payload)
    else:
      fn = sideinputs._global_window_mapping_fn  # pylint: disable=protected-access
    gates.append(
        (fn, side_watermarks.get((spec.transform_id, spec.tag), MAX_MICROS)))

  def ready(wv) -> bool:
    for fn, watermark in gates:
      if watermark >= MAX_MICROS:
        continue
      for window in wv.windows:
        try:
          end = Timestamp.of(fn(window).end).micros
        except Exception:  # pylint: disable=broad-except
          # A window the runner sees as opaque bytes: not held.
          continue
        if watermark < min(end, MAX_MICROS):
          return False
    return True

  return ready


def hold_back(runtime: JobRuntime, stage: StagePlan, ready,
              records: Iterable, held: list) -> Iterator:
  """``records`` of (input id, chunk) with the elements not ``ready`` taken
  out into ``held`` as (input id, encoded element, timestamp micros)."""
  for transform_id, chunk in records:
    if transform_id not in stage.input_coders:
      # Not main input (a streaming read's endpoint, worker.endpoints).
      yield transform_id, chunk
      continue
    impl = runtime.coder_impl(stage.input_coders[transform_id])
    keep = []
    for wv in decode_all(impl, [chunk]):
      encoded = impl.encode_nested(wv)
      if ready(wv):
        keep.append(encoded)
      else:
        held.append((transform_id, encoded, wv.timestamp.micros))
    if keep:
      yield transform_id, b''.join(keep)


class TestStreamElements:
  """A task's function: a TestStream's (timestamp micros, encoded element)
  events -> chunks of windowed values in the SDK's data channel coding (global window, as
  Beam's TestStream emits them).

  An element whose coder Python knows is decoded (a Python TestStream's
  element may carry its own windows) and encoded again; one of another
  SDK's coder stays bytes, written as the data channel's length-prefixed
  element. ``nested``: the SDK encoded the elements in the nested context
  (Go's; planning.sdks.teststream_elements_nested).
  """
  __test__ = False  # not a pytest test class

  def __init__(self, ctx, element_coder_id: str,
               channel_coder_id: str, safe_channel_coder_id: str = '',
               nested: bool = False):
    self.ctx = ctx
    self.element_coder_id = element_coder_id
    self.channel_coder_id = channel_coder_id
    self.safe_channel_coder_id = safe_channel_coder_id or channel_coder_id
    self.nested = nested

  def __call__(self, events):
    from apache_beam.coders import coders  # pylint: disable=import-outside-toplevel
    from apache_beam.testing.test_stream import WindowedValueHolder  # pylint: disable=import-outside-toplevel
    runtime = self.ctx.runtime()
    if python_knows_coder(runtime.components, self.element_coder_id):
      element_impl = runtime.coder_impl(self.element_coder_id)
      channel_impl = runtime.coder_impl(self.channel_coder_id)
      decode = (element_impl.decode_nested if self.nested else
                element_impl.decode)
    else:
      # The safe channel coder's element is bytes: its nested encoding, a
      # length and the bytes, is the SDK's length-prefixed element.
      channel_impl = runtime.coder_impl(self.safe_channel_coder_id)
      raw = coders.BytesCoder().get_impl()
      decode = raw.decode_nested if self.nested else bytes

    def windowed(micros, encoded):
      value = decode(encoded)
      if isinstance(value, WindowedValueHolder):
        # An element given with its windows (and pane): emitted as it is,
        # as Beam's DirectRunner does.
        return value.windowed_value
      return beam_window.GlobalWindows.windowed_value(
          value, timestamp=Timestamp(micros=micros))

    return elements.encode_stream(
        channel_impl, (windowed(*event) for event in events))
