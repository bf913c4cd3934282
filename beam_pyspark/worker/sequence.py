"""A streaming job's ``PeriodicImpulse`` read a whole grant at a time.

Beam's ``ImpulseSeqGenDoFn`` (``PeriodicImpulse``, ``PeriodicSequence``)
claims one offset of its ``OffsetRange`` at a time and outputs one
``TimestampedValue`` per claim, through the SDK harness's per-element
machinery (a claim, a watermark estimate, a ``Timestamp``, window
assignment, an output receiver): in the issue-32 profile three quarters of
the read's CPU, in one task, since the range is one restriction.

For a stage that is that DoFn alone (its input, the splittable DoFn, its
output: as ``planning.readbreak`` leaves a streaming job's unbounded read),
with no data of its own (the timestamps are the values) and its input in
the global window, ``SequenceRead`` does in the worker what the DoFn does
under the runner's grant (``worker.endpoints``), all of it at once: the
offsets due by now (``start + interval * i <= time.time()``, Beam's float
arithmetic), at most the grant, each output with the float as value and
event time (``Timestamp.of``) in the global window; its watermark
estimator at the last output's timestamp, or at the next offset's when
that one is not due yet; what is left of the range as the residual, the
way the DoFn's ``defer_remainder`` leaves it (deferred to the next offset's
time when that is not due; at once, and busy, when the grant ran out). A
restriction that is done leaves nothing. The runner's halving of a busy
endpoint is declined (a split is the runner's to ask and the restriction's
to refuse; halving a range of offsets not yet due spreads nothing), and
its time limit checkpoints between chunks as the runner's checkpoint would.
tests/test_sequence_read.py holds it equal to Beam's DoFn in Beam's
harness, residual for residual.
"""

from __future__ import annotations

import time
from typing import Iterator
from typing import Optional

from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.coders.coder_impl import create_OutputStream
from apache_beam.internal import pickler
from apache_beam.metrics import monitoring_infos
from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners import pipeline_context
from apache_beam.transforms import periodicsequence
from apache_beam.transforms import window
from apache_beam.utils import windowed_value
from apache_beam.utils.timestamp import Timestamp

from beam_pyspark.planning.plan import DATA_INPUT_URN
from beam_pyspark.planning.plan import DATA_OUTPUT_URN
from beam_pyspark.worker import endpoints
from beam_pyspark.worker.elements import split_elements

_PROCESS = common_urns.sdf_components.PROCESS_SIZED_ELEMENTS_AND_RESTRICTIONS.urn
# Offsets between two looks at the clock (the time limit).
CHUNK = 8192
_GLOBAL = (window.GlobalWindow(), )
# Offsets output compact only with times this far from the epoch: Beam's
# windowed value coder restores its MIN and MAX timestamps (~9.2e9 s).
_SAFE_SECS = 9e9
# An encoded chunk's elements: (width unused), the global window, no pane.
_PLAIN = (0, _GLOBAL, windowed_value.PANE_INFO_UNKNOWN)
# Serialized descriptor -> its SequenceRead, or None.
_reads: dict = {}


class Offsets:
  """A chunk of a sequence read's output as what it is, not its bytes:
  offsets ``lo`` to ``hi`` of ``start + interval * i``, each value its own
  event time in the global window (``elements``). A read whose only
  consumers are fast-path stages hands them this (``Limits.compact``): the
  encoding and decoding of every element (a third of the streaming
  benchmark's worker time) are skipped, and Spark moves ~100 bytes for
  8,192 elements. Anything else that reads it takes ``encode``'s bytes
  (a harness: ``StageRunner``), which are the read's own otherwise. ``len``
  is the bytes it stands for, as bundles are cut by the bytes of their
  input."""
  __slots__ = ('start', 'interval', 'lo', 'hi', 'width', 'windows', 'pane')

  def __init__(self, start: float, interval: float, lo: int, hi: int,
               width: int, windows: tuple, pane):
    self.start, self.interval, self.lo, self.hi = start, interval, lo, hi
    self.width, self.windows, self.pane = width, windows, pane

  def __reduce__(self):
    return Offsets, (self.start, self.interval, self.lo, self.hi, self.width,
                     self.windows, self.pane)

  def __len__(self) -> int:
    return (self.hi - self.lo) * self.width

  def elements(self) -> Iterator:
    """The WindowedValues the output coder would have decoded: their
    timestamps in milliseconds, truncated towards zero as it does."""
    create, start, interval = windowed_value.create, self.start, self.interval
    windows, pane = self.windows, self.pane
    for i in range(self.lo, self.hi):
      t = start + interval * i
      micros = int(t * 1000000)
      yield create(t, (micros // 1000 * 1000 if micros >= 0 else
                       -(-micros // 1000 * 1000)), windows, pane)

  def encode(self, impl) -> bytes:
    out = create_OutputStream()
    encode = impl.encode_to_stream
    for wv in self.elements():
      encode(wv, out, True)
    return out.get()


def port_impl(descriptor: beam_fn_api_pb2.ProcessBundleDescriptor,
              transform_id: str):
  """The coder (impl) of a stage's data input as its harness decodes it:
  what a compact chunk it is handed is encoded with."""
  key = (id(descriptor), transform_id)
  found = _ports.get(key)
  if found is None or found[0] is not descriptor:
    port = beam_fn_api_pb2.RemoteGrpcPort.FromString(
        descriptor.transforms[transform_id].spec.payload)
    impl = pipeline_context.PipelineContext(descriptor).coders[
        port.coder_id].get_impl()
    if len(_ports) >= 16:
      _ports.clear()
    found = _ports[key] = (descriptor, impl)
  return found[1]


_ports: dict = {}


class SequenceRead:
  """Reads granted restrictions of one stage (``of`` says whether it is
  such a stage)."""

  def __init__(self, input_id: str, output_id: str, in_impl, out_impl,
               provider, pcolls: tuple[str, str]):
    self.input_id = input_id  # the DATA_INPUT transform
    self.output_id = output_id  # the DATA_OUTPUT transform
    self._in = in_impl
    self._out = out_impl
    self._provider = provider
    self._pcolls = pcolls  # (restrictions, outputs)
    self._template = self._compact_template(out_impl)

  @staticmethod
  def _compact_template(impl) -> Optional[tuple]:
    """(bytes per element, windows, pane) of the output as its coder
    decodes it, if the coder gives back the float it was given, exactly
    (FloatCoder, Beam's primitives coder...): else None, and the read
    always outputs bytes."""
    found = []
    for value in (1234.5 + 1e-9, -1234.5678919):
      try:
        data = impl.encode_nested(windowed_value.create(
            value, int(value * 1000000), _GLOBAL))
        back = impl.decode_nested(data)
      except Exception:  # pylint: disable=broad-except
        return None
      (made, ) = Offsets(value, 1.0, 0, 1, 0, back.windows,
                         back.pane_info).elements()
      if (type(back.value) is not float or back.value != value or  # pylint: disable=unidiomatic-typecheck
          back.timestamp_micros != made.timestamp_micros or
          tuple(back.windows) != _GLOBAL):
        return None
      found.append((len(data), back.windows, back.pane_info))
    return found[0]

  @classmethod
  def of(cls, descriptor: beam_fn_api_pb2.ProcessBundleDescriptor
         ) -> Optional['SequenceRead']:
    """The stage's read, or None if it is not ``ImpulseSeqGenDoFn`` alone
    (without data) between its input and output, in the global window
    (kept per Python worker)."""
    key = descriptor.SerializeToString()
    if key not in _reads:
      if len(_reads) >= 16:
        _reads.clear()
      _reads[key] = cls._of(descriptor)
    return _reads[key]

  @classmethod
  def _of(cls, descriptor) -> Optional['SequenceRead']:
    transforms = descriptor.transforms
    by_urn = {t.spec.urn: (tid, t) for tid, t in transforms.items()}
    if len(transforms) != 3 or set(by_urn) != {
        DATA_INPUT_URN, _PROCESS, DATA_OUTPUT_URN}:
      return None
    (in_id, read), (_, sdf), (out_id, write) = (
        by_urn[DATA_INPUT_URN], by_urn[_PROCESS], by_urn[DATA_OUTPUT_URN])
    if (list(sdf.inputs.values()) != list(read.outputs.values()) or
        list(sdf.outputs.values()) != list(write.inputs.values())):
      return None
    payload = beam_runner_api_pb2.ParDoPayload.FromString(sdf.spec.payload)
    if (payload.do_fn.urn != python_urns.PICKLED_DOFN_INFO or
        payload.side_inputs or payload.state_specs or
        payload.timer_family_specs or payload.requires_stable_input or
        payload.requires_time_sorted_input):
      return None
    context = pipeline_context.PipelineContext(descriptor)
    (pcoll_in, ), (pcoll_out, ) = sdf.inputs.values(), sdf.outputs.values()
    strategy = descriptor.windowing_strategies[
        descriptor.pcollections[pcoll_in].windowing_strategy_id]
    if strategy.window_fn.urn != common_urns.global_windows.urn:
      return None
    try:
      dofn_data = pickler.loads(payload.do_fn.payload)
    except Exception:  # pylint: disable=broad-except
      return None  # the harness says why
    dofn = dofn_data[0]
    if (type(dofn) is not periodicsequence.ImpulseSeqGenDoFn or  # pylint: disable=unidiomatic-typecheck
        dofn._data is not None):  # pylint: disable=protected-access
      return None
    ports = [beam_fn_api_pb2.RemoteGrpcPort.FromString(t.spec.payload)
             for t in (read, write)]
    in_impl, out_impl = (context.coders[p.coder_id].get_impl() for p in ports)
    return cls(in_id, out_id, in_impl, out_impl,
               periodicsequence.ImpulseSeqGenRestrictionProvider(),
               (pcoll_in, pcoll_out))

  def read(self, element: bytes, limits: endpoints.Limits,
           endpoint_id: Optional[str] = None,
           metrics: Optional[list] = None) -> Iterator[tuple[str, object]]:
    """Yields (output transform id, chunk) and then, if the restriction is
    not done, (RESIDUAL_TAG, Residual): as the DoFn's bundle under
    ``limits`` (records: its grant; secs: its time). Its element counts
    go to ``metrics``, as a bundle's monitoring infos."""
    wv = self._in.decode_from_stream(create_InputStream(element), True)
    (seq, (offsets, estimate)), _ = wv.value
    start, _, interval = seq
    if isinstance(start, Timestamp):
      start = start.micros / 1000000
    lo, hi = offsets.start, offsets.stop
    grant = (1 << 62) if limits.records is None else max(1, limits.records)
    began, now = time.monotonic(), time.time()
    # The first offset not due: start + interval * i > now, as the DoFn
    # computes it (the estimate, then corrected both ways).
    due = max(lo, min(hi, int((now - start) / interval)))
    while due > lo and start + interval * (due - 1) > now:
      due -= 1
    while due < hi and start + interval * due <= now:
      due += 1
    end = min(due, lo + grant)
    impl = self._out
    template = self._template if limits.compact else None
    if template is not None and max(abs(start + interval * lo),
                                    abs(start + interval * hi)) > _SAFE_SECS:
      template = None  # near Beam's MIN/MAX timestamps, which its coder keeps
    at, by_time = lo, False
    while at < end:
      upto = min(end, at + CHUNK)
      chunk = Offsets(start, interval, at, upto, *(template or _PLAIN))
      yield self.output_id, chunk if template is not None else chunk.encode(
          impl)
      at = upto
      if at < end and time.monotonic() - began >= limits.secs:
        by_time = True  # the runner's checkpoint, between two claims
        break
    if metrics is not None:
      metrics.extend(monitoring_infos.int64_counter(
          monitoring_infos.ELEMENT_COUNT_URN, count, pcollection=pcoll)
                     for pcoll, count in zip(self._pcolls, (1, at - lo)))
    if at > lo:
      last = Timestamp.of(start + interval * (at - 1))
      if estimate is None or last > estimate:
        estimate = last
    if at >= hi:
      return  # done: nothing left to claim
    delay = 0
    if not by_time and (start + interval * at) > now:
      # Not due yet: the DoFn sets its watermark to the next offset's time
      # and defers the rest to it.
      following = Timestamp(start + interval * at)
      if estimate is None or following > estimate:
        estimate = following
      delay = (following - Timestamp.now()).micros
    rest = type(offsets)(at, hi)
    size = self._provider.restriction_size(seq, rest)
    residual = self._in.encode_nested(
        wv.with_value(((seq, (rest, estimate)), size)))
    yield endpoints.RESIDUAL_TAG, endpoints.Residual(
        self.input_id, residual,
        estimate.micros if estimate is not None else None,
        int(time.time() * 1_000_000) + max(0, delay),
        float(size), endpoint_id, not by_time and at == lo + grant,
        repr(at - 1) if at > lo else None)


def bundle_read(descriptor, data: dict, timers: dict,
                limits: endpoints.Limits) -> Optional[tuple]:
  """(SequenceRead, its one element) for a bundle of a streaming
  splittable stage that reads one restriction of ``ImpulseSeqGenDoFn``
  alone, with no byte limit (Beam's sampled sizes); else None (the harness
  runs it)."""
  if timers and any(timers.values()) or limits.size is not None:
    return None
  read = SequenceRead.of(descriptor)
  if read is None or set(data) - {read.input_id}:
    return None
  elements = list(split_elements(read._in, data.get(read.input_id, ())))  # pylint: disable=protected-access
  return (read, elements[0]) if len(elements) == 1 else None
