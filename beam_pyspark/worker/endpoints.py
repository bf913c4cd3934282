"""Inside executors: a streaming job's splittable reads, granted a budget.

In a streaming job the live restrictions of an unbounded splittable DoFn
(an unbounded SDF's residuals, ``PeriodicImpulse``'s, an
``UnboundedSource``'s splits) are its *endpoints*: the driver keeps them
between micro-batches, and each micro-batch runs every endpoint it grants
records to as a bundle of its own (``spark.streaming``). A bundle here runs
until its restriction checkpoints itself (``ProcessContinuation.resume``,
``defer_remainder``) or the runner checkpoints it (``Checkpointer``): once
it has output its grant, or run for the micro-batch's longest bundle. What
is left becomes endpoints again (``Residual`` records), with the output
watermark its watermark estimator reported, when it asked to be resumed
and its backlog (the restriction's size).

Nothing here knows Spark: records in, records out.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable
from typing import Optional

from apache_beam.metrics import monitoring_infos
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.worker import bundle_processor

from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.harnesses.base import name_channel_splits

# A task's records carrying a residual restriction for the driver:
# (RESIDUAL_TAG, Residual). Input records of an endpoint to run:
# (ENDPOINT_TAG, Granted).
RESIDUAL_TAG = '\x00endpoint-residual'
ENDPOINT_TAG = '\x00endpoint'

# How often a running bundle's progress is read, at most and at least.
MIN_POLL_SECS = 0.002
MAX_POLL_SECS = 0.05
# A bundle still running after this long (or this many times its time
# limit, if more) is stuck in its DoFn: its task fails, naming it.
HANG_SECS = 300
HANG_FACTOR = 20


@dataclasses.dataclass(frozen=True)
class Limits:
  """How long a streaming splittable bundle may run before the runner
  checkpoints it: ``records`` output elements of the splittable DoFn (None:
  no limit), ``secs`` seconds, ``size`` bytes of output (as Beam samples
  element sizes; None: no limit). ``compact``: a sequence read may output
  its chunks as ``worker.sequence.Offsets`` (its consumers read them)."""
  records: Optional[int]
  secs: float
  size: Optional[int] = None
  compact: bool = False


@dataclasses.dataclass(frozen=True)
class Granted:
  """An endpoint to run in this micro-batch: its restriction (the encoded
  sized element of input ``input_id``) and its grant of records."""
  endpoint_id: str
  input_id: str
  element: bytes
  grant: Optional[int]  # records (None: no limit)
  grant_bytes: Optional[int] = None
  # Split it in two as it starts (it used all of its last grant: a busy
  # endpoint, whose backlog more endpoints read sooner).
  split: bool = False


@dataclasses.dataclass(frozen=True)
class Residual:
  """What a bundle left of a restriction, for a later micro-batch."""
  input_id: str
  element: bytes  # the sized element, encoded as the input's elements
  # Output watermark its watermark estimator reported (micros); None when
  # it reported none (the output is then held at the minimum).
  watermark: Optional[int]
  # When it may run again (wall-clock micros).
  resume_at: int
  # Its restriction's size: records (or bytes) still to read; None when
  # unknown or infinite.
  backlog: Optional[float]
  # The endpoint it is what is left of (its first residual keeps its id).
  parent: Optional[str] = None
  # Left by the runner's checkpoint (the bundle reached its limits), not
  # by the restriction's own: it had more to read than it was granted.
  busy: bool = False
  # The last position its bundle claimed, for people (in-process only).
  position: Optional[str] = None


# -- claim budgets: a grant enforced at the restriction tracker ---------------


class ClaimBudget:
  """Claims one bundle's restriction trackers may still succeed at; and,
  for a bundle whose restriction the runner splits in two as it starts,
  the rendezvous of that split (``first_claim``, then ``halved``)."""
  def __init__(self, limit: int, halve: bool = False):
    self.limit = limit
    self.claims = 0
    self.exhausted = False
    # The last position claimed (where the bundle's read is), for people.
    self.position = None
    self.halve = halve
    self.first_claim = threading.Event()
    self.halved = threading.Event()


# Bundle thread name -> its budget (an in-process harness runs each bundle
# in a thread of its own, worker.harnesses.embedded).
_claim_budgets: dict[str, ClaimBudget] = {}
_installed = False


# How long a bundle waits at its first claim for the runner to split it.
HALVE_WAIT_SECS = 2.0


def set_claim_budget(thread_name: str, limit: Optional[int],
                     halve: bool = False) -> Optional[ClaimBudget]:
  """Limits the claims of the bundle that runs in thread ``thread_name``:
  once a restriction tracker of it claimed ``limit`` positions, it checkpoints
  itself (``defer_remainder``): its next claim fails, the DoFn returns, and
  the rest is the bundle's residual. Polling the bundle's progress
  (``Checkpointer``) cannot do that for a fast source: Python switches
  threads every few milliseconds, in which an SDF outputs thousands of
  records. ``halve``: at its first claim the bundle waits (at most
  HALVE_WAIT_SECS) for the runner to split its restriction in two
  (``Checkpointer``), which a fast source would otherwise have finished
  reading before the runner's split request is served."""
  _install()
  budget = _claim_budgets[thread_name] = ClaimBudget(
      max(1, limit) if limit is not None else 1 << 62, halve)
  return budget


def clear_claim_budget(thread_name: str) -> None:
  _claim_budgets.pop(thread_name, None)


def _install() -> None:
  """Beam's invoker wraps each restriction tracker in its module's
  ThreadsafeRestrictionTracker: that name, in this process, becomes a
  subclass that counts the claims of bundles with a budget (others pay a
  dict lookup per claim)."""
  global _installed
  if _installed:
    return
  from apache_beam.runners import common
  from apache_beam.runners import sdf_utils
  base = sdf_utils.ThreadsafeRestrictionTracker

  class BudgetedRestrictionTracker(base):
    def try_claim(self, position):
      claimed = base.try_claim(self, position)
      if claimed and _claim_budgets:
        budget = _claim_budgets.get(threading.current_thread().name)
        if budget is None:
          return claimed
        budget.position = position
        if budget.halve and not budget.first_claim.is_set():
          budget.first_claim.set()
          budget.halved.wait(HALVE_WAIT_SECS)
        budget.claims += 1
        if budget.claims >= budget.limit:
          # The claimed position is read; what follows is the residual
          # (and every later restriction of the bundle reads one record).
          budget.exhausted = True
          self.defer_remainder()
      return claimed

  common.ThreadsafeRestrictionTracker = BudgetedRestrictionTracker
  _installed = True


def splittable_input(descriptor) -> Optional[str]:
  """The DATA_INPUT feeding a splittable DoFn's process step, if any."""
  sdf_urn = common_urns.sdf_components.PROCESS_SIZED_ELEMENTS_AND_RESTRICTIONS.urn
  truncate_urn = common_urns.sdf_components.TRUNCATE_SIZED_RESTRICTION.urn
  transforms = descriptor.transforms
  consumers: dict[str, list] = {}
  for proto in transforms.values():
    for pcoll in proto.inputs.values():
      consumers.setdefault(pcoll, []).append(proto)

  def feeds_sdf(pcoll, depth=0):
    for c in consumers.get(pcoll, ()):
      if c.spec.urn == sdf_urn:
        return True
      if c.spec.urn == truncate_urn and depth < 2:
        if any(feeds_sdf(p, depth + 1) for p in c.outputs.values()):
          return True
    return False

  for read_id, proto in transforms.items():
    if proto.spec.urn == bundle_processor.DATA_INPUT_URN and any(
        feeds_sdf(p) for p in proto.outputs.values()):
      return read_id
  return None


def splittable_transform(descriptor) -> Optional[tuple[str, list[str]]]:
  """The descriptor's splittable DoFn: (its transform id, the PCollections
  it outputs), whose elements are what a grant counts."""
  urn = common_urns.sdf_components.PROCESS_SIZED_ELEMENTS_AND_RESTRICTIONS.urn
  for transform_id, proto in descriptor.transforms.items():
    if proto.spec.urn == urn:
      return transform_id, list(proto.outputs.values())
  return None


def residual(runtime, coder_id: str, input_id: str,
             application: beam_fn_api_pb2.BundleApplication,
             delay_micros: int = 0, parent: Optional[str] = None,
             busy: bool = False, position=None) -> Residual:
  """A residual root (self- or runner-initiated checkpoint) as a Residual."""
  marks = [ts.seconds * 1_000_000 + ts.nanos // 1000
           for ts in application.output_watermarks.values()]
  if position is not None:
    position = repr(position)[:120]
  else:  # out of process: no claims seen; what the restriction reads
    position = element_label(runtime, coder_id, application.element)
  return Residual(
      input_id, application.element, min(marks) if marks else None,
      _now_micros() + max(0, delay_micros),
      backlog_of(runtime, coder_id, application.element), parent, busy,
      position)


def unread(runtime, coder_id: str, input_id: str, element: bytes) -> Residual:
  """An input element a checkpoint's channel split left unread."""
  return Residual(input_id, element, None, _now_micros(),
                  backlog_of(runtime, coder_id, element))


def backlog_of(runtime, coder_id: str, element: bytes) -> Optional[float]:
  """A sized restriction's size (None: unknown or infinite)."""
  try:
    wv = next(decode_all(runtime.coder_impl(coder_id), [element]))
    size = float(wv.value[1])
  except Exception:  # pylint: disable=broad-except
    return None
  if size != size or size == float('inf') or size < 0:
    return None
  return size


def element_label(runtime, coder_id: str, element: bytes) -> Optional[str]:
  """What a restriction reads, for people, when its element is a schema
  row: its set scalar fields (``topic=t, partition=1``); for a row of
  another SDK's schema coder (opaque here: Java's SchemaCoder is a
  serialized Java object), its leading scalar fields by value (Kafka's
  KafkaSourceDescriptor: ``events/1``, its topic and partition). None
  otherwise."""
  try:
    wv = next(decode_all(runtime.coder_impl(coder_id), [element]))
    row = wv.value[0][0]
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(row, bytes):
    return _opaque_row_label(row)
  try:
    fields = row._asdict()
  except AttributeError:
    return None
  shown = [f'{k}={v}' for k, v in fields.items()
           if isinstance(v, (str, int, float)) and not isinstance(v, bool)]
  return ', '.join(shown)[:120] or None


def _varint(data: bytes, at: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[at]
    at += 1
    value |= (byte & 0x7f) << shift
    shift += 7
    if not byte & 0x80:
      return value, at


def _opaque_row_label(data: bytes) -> Optional[str]:
  """Beam's row encoding (field count, null bitmap, the set fields in
  order) read without its schema: the leading set fields that read as a
  short printable string, then those that read as an integer (the rest
  need the schema); None if it does not parse so."""
  try:
    count, at = _varint(data, 0)
    size, at = _varint(data, at)
    nulls = int.from_bytes(data[at:at + size], 'little')
    at += size
    values = []
    for i in range(min(count, 8)):
      if nulls >> i & 1:
        continue
      length, after = _varint(data, at)
      text = data[after:after + length]
      if (not values and 0 < length <= 200 and len(text) == length and
          text.decode('utf-8').isprintable()):
        values.append(text.decode('utf-8'))
        at = after + length
      elif values:
        values.append(str(length))
        break
      else:
        return None
  except (IndexError, UnicodeDecodeError):
    return None
  return '/'.join(values) if len(values) == 2 else None


def _now_micros() -> int:
  return int(time.time() * 1_000_000)


class Checkpointer:
  """Checkpoints a running splittable bundle once it reached its limits.

  A thread reads the bundle's progress (the element count of the
  splittable DoFn's outputs) and, once the grant is output or the time is
  up, asks the harness to split the bundle at ``fraction_of_remainder``
  0: a checkpoint, as Beam's DirectRunner takes one after a number of
  outputs or a duration. The restriction tracker then refuses further
  claims, the DoFn returns, and the split's residual roots (and input
  elements the bundle will not read) are the response's. A harness that
  cannot split yet (between claims) is asked again at the next poll.
  """
  def __init__(self, harness, instruction_id: str, input_id: str,
               counted: list[str], limits: Limits, split: bool = False,
               budget: Optional[ClaimBudget] = None,
               on_hang: Optional[Callable[[float], None]] = None):
    self.harness = harness
    # on_hang(seconds): the bundle ran HANG_SECS (or HANG_FACTOR times its
    # limit) and would not stop; the caller ends it.
    self.on_hang = on_hang
    # Whether the checkpoint was the grant's (the endpoint had more to
    # read than it was granted: busy), not the time's.
    self.by_grant = False
    # An in-process bundle's claim budget: it says when to halve it.
    self.budget = budget
    self.instruction_id = instruction_id
    self.input_id = input_id
    self.counted = set(counted)
    self.limits = limits
    # First split the bundle's restriction in two, as soon as it runs.
    self.split = split
    # The splits taken: the halving (if asked), then the checkpoint.
    self.results: list[beam_fn_api_pb2.ProcessBundleSplitResponse] = []
    self._finished = threading.Event()
    self._thread = threading.Thread(
        target=self._watch, name=f'checkpoint-{instruction_id}', daemon=True)

  def start(self) -> 'Checkpointer':
    self._thread.start()
    return self

  def stop(self) -> list[beam_fn_api_pb2.ProcessBundleSplitResponse]:
    """Once the bundle ended: the splits taken (none, the halving, the
    checkpoint)."""
    self._finished.set()
    self._thread.join()
    return self.results

  def _watch(self) -> None:
    budget = self.budget
    if self.split and budget is not None:
      # The bundle waits at its first claim for this split.
      while not (budget.first_claim.wait(MAX_POLL_SECS) or
                 self._finished.is_set()):
        pass
      if budget.first_claim.is_set():
        self._split(0.5)
      self.split = False
      budget.halved.set()
    started = time.monotonic()
    limit = self.limits.records
    hang = max(HANG_SECS, HANG_FACTOR * self.limits.secs)
    wait = MIN_POLL_SECS
    while not self._finished.wait(wait):
      elapsed = time.monotonic() - started
      if elapsed >= hang and self.on_hang is not None:
        self.on_hang(elapsed)
        return
      if budget is not None and self.limits.size is None and not self.split:
        # In process the claim budget checkpoints at the grant itself: the
        # time limit is all that is left here, so no progress is polled
        # (each poll costs the bundle's thread the monitoring infos).
        if elapsed >= self.limits.secs and budget.claims > 0 and (
            self._split(0)):
          return
        wait = min(max(self.limits.secs - elapsed, MAX_POLL_SECS / 5),
                   max(MIN_POLL_SECS, hang - elapsed))
        continue
      progress = self._progress()
      if progress is None:  # not started yet, or ended
        wait = MAX_POLL_SECS / 5
        continue
      count, size = progress
      # It made progress: a claim (in process, counted), else an output. A
      # split before its first claim would take all of its work, so that a
      # DoFn that polls and then claims (Beam's Watch) loses its poll: a
      # slow one would never progress.
      moved = count > 0 or (budget is not None and budget.claims > 0)
      if self.split and moved and self._split(0.5):
        self.split = False
      by_grant = (limit is not None and count >= limit) or (
          self.limits.size is not None and size >= self.limits.size)
      if (by_grant or (moved and elapsed >= self.limits.secs)) and (
          self._split(0)):
        self.by_grant = by_grant
        return
      # Poll again about when half the rest of the grant is due at this
      # rate, or the time is up.
      rate = count / elapsed if elapsed > 0 else 0.0
      wait = max(0.0, self.limits.secs - elapsed)
      if limit is not None and rate > 0:
        wait = min(wait, (limit - count) / rate / 2)
      wait = min(MAX_POLL_SECS, max(MIN_POLL_SECS, wait))

  def _progress(self) -> Optional[tuple[int, float]]:
    """(elements, estimated bytes) the splittable DoFn output so far."""
    try:
      response = self.harness.do(beam_fn_api_pb2.InstructionRequest(
          process_bundle_progress=beam_fn_api_pb2.
          ProcessBundleProgressRequest(instruction_id=self.instruction_id)))
    except Exception:  # pylint: disable=broad-except
      return None  # the harness went; the bundle fails by itself
    if response.error or self._finished.is_set():
      return None
    progress = response.process_bundle_progress
    if not progress.monitoring_infos:
      return None  # not running (yet, or any more)
    count, sampled, sampled_bytes = 0, 0, 0
    for info in progress.monitoring_infos:
      if info.labels.get(monitoring_infos.PCOLLECTION_LABEL) not in (
          self.counted):
        continue
      if info.urn == monitoring_infos.ELEMENT_COUNT_URN:
        count += monitoring_infos.extract_counter_value(info)
      elif info.urn == monitoring_infos.SAMPLED_BYTE_SIZE_URN:
        data = monitoring_infos.extract_distribution(info)
        sampled += data[0]
        sampled_bytes += data[1]
    size = count * sampled_bytes / sampled if sampled else 0.0
    return count, size

  def _split(self, fraction: float) -> bool:
    """Splits the running bundle at ``fraction`` of its remainder (0: a
    checkpoint); whether it split (a restriction that cannot split, e.g.
    an unbounded one halved, or a bundle between claims, does not)."""
    if self._finished.is_set():
      return True
    try:
      response = self.harness.do(beam_fn_api_pb2.InstructionRequest(
          process_bundle_split=beam_fn_api_pb2.ProcessBundleSplitRequest(
              instruction_id=self.instruction_id,
              desired_splits={
                  self.input_id: beam_fn_api_pb2.ProcessBundleSplitRequest.
                  DesiredSplit(fraction_of_remainder=fraction)
              })))
    except Exception:  # pylint: disable=broad-except
      return False  # the bundle ended meanwhile, or the harness went
    if response.error:
      return False
    split = name_channel_splits(response.process_bundle_split, self.input_id)
    if split.residual_roots or split.channel_splits:
      self.results.append(split)
      return True
    return False
