"""A streaming job for the driver-kill tests (test_streaming_recovery.py).

    python streaming_recovery_job.py OUT_DIR CHECKPOINT_DIR [--kill-mid-batch]
        [PIPELINE OPTIONS...]

A TestStream of several micro-batches into three branches, each with
state the engine must carry across batches and restore from a checkpoint:
windowed sums under early, on-time and late firings (accumulating), a
stateful DoFn with bag and combining state and an event-time timer, and
Beam's own file sink (fileio.WriteToFiles: temporary files, renamed once
their window closes) into OUT_DIR/files. Each
output element is written to OUT_DIR/out as a file named by its content,
through a temporary name and a rename: an idempotent sink, so a batch run
again after a crash rewrites the same files, and any output that differs
(a pane counted twice, state lost) shows as a file of its own.

--kill-mid-batch: the task that meets element KILL_AT (in micro-batch 3)
SIGKILLs this driver, once (a marker file in OUT_DIR says it happened).

--stall=DIR: the task that meets the element the kill would happen at
writes its Python worker's pid to DIR/executor and waits, on its first
attempt only (a cluster test kills that worker's executor).

--source=sdf: the events come from an unbounded splittable DoFn instead
(SHARDS restrictions, each RECORDS records at rising event times, each
checkpointing itself every CHUNK records and reporting its watermark),
read over many micro-batches under a small budget; the windows fire with
the default trigger only (what the watermark decides, so any runner gives
the same panes). The task that meets element SDF_KILL_AT kills the driver.

``build_sums``: a shorter job of the same parts (the splittable read, the
windowed sums, the idempotent sink) that test_jobserver_resume.py sends
to a job server it stops and kills.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import sys
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms import trigger
from apache_beam.transforms import userstate
from apache_beam.transforms import window
from apache_beam.coders import VarIntCoder
from apache_beam.io import fileio
from apache_beam.io.restriction_trackers import OffsetRange
from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.utils.timestamp import Timestamp

KILL_AT = 301  # micro-batch 4 (the first holds only a watermark)
BATCHES = 6


def test_stream():
  stream = TestStream().advance_watermark_to(0)
  for b in range(BATCHES):
    stream = stream.add_elements([
        window.TimestampedValue((f'k{i % 3}', 100 * b + i), 10 * b + i)
        for i in range(5)])
    if b >= 2:  # late for the window the watermark passed, within lateness
      stream = stream.add_elements(
          [window.TimestampedValue(('k0', 1000 + b), 10 * b - 15)])
    stream = stream.advance_processing_time(5).advance_watermark_to(
        10 * (b + 1))
  return stream.advance_watermark_to_infinity()


SHARDS, RECORDS, CHUNK = 3, 24, 4
SDF_KILL_AT = 112  # shard 1's record 12: micro-batch 3 or so
# A micro-batch's budget in the sdf mode: many micro-batches.
SDF_BUDGET = 12


class ShardProvider(beam.transforms.core.RestrictionProvider):
  def initial_restriction(self, shard):
    return OffsetRange(0, RECORDS)

  def create_tracker(self, restriction):
    return OffsetRestrictionTracker(restriction)

  def restriction_size(self, shard, restriction):
    return restriction.size()


class _Shards(beam.DoFn):
  """Shard s: records (k<s>, 100 s + i) at event time 10 i + s seconds."""
  @beam.DoFn.unbounded_per_element()
  def process(
      self, shard,
      tracker=beam.DoFn.RestrictionParam(ShardProvider()),
      estimator=beam.DoFn.WatermarkEstimatorParam(
          ManualWatermarkEstimator.default_provider())):
    position = tracker.current_restriction().start
    for _ in range(CHUNK):
      if not tracker.try_claim(position):
        return
      at = Timestamp(10 * position + shard)
      estimator.set_watermark(at)
      yield window.TimestampedValue((f'k{shard}', 100 * shard + position), at)
      position += 1
    tracker.defer_remainder()


class _StallOnce(beam.DoFn):
  """On its first attempt, the task that meets element ``at`` writes its
  Python worker's pid to MARKERS/executor and waits to be killed (with
  its executor, by the test); a retry goes on."""
  def __init__(self, markers, at):
    self.markers = markers
    self.at = at

  def process(self, element):
    if element[1] == self.at:
      marker = os.path.join(self.markers, 'executor')
      try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
      except FileExistsError:
        pass  # a retry
      else:
        os.write(fd, json.dumps({'pid': os.getpid()}).encode())
        os.close(fd)
        time.sleep(600)
    yield element


def sdf_events(p):
  return p | beam.Create(list(range(SHARDS))) | beam.ParDo(_Shards())


class _KillDriver(beam.DoFn):
  def __init__(self, out_dir, at=KILL_AT):
    self.out_dir = out_dir
    self.at = at

  def process(self, element):
    marker = os.path.join(self.out_dir, 'killed')
    if element[1] == self.at and not os.path.exists(marker):
      with open(marker, 'w', encoding='utf-8') as f:
        f.write('mid-batch')
      with open(os.path.join(self.out_dir, 'driver.pid'),
                encoding='utf-8') as f:
        os.kill(int(f.read()), signal.SIGKILL)
      time.sleep(60)  # the driver's end ends this task
    yield element


class _SumAtWindowEnd(beam.DoFn):
  SEEN = userstate.BagStateSpec('seen', VarIntCoder())
  TOTAL = userstate.CombiningValueStateSpec(
      'total', VarIntCoder(), beam.combiners.CountCombineFn())
  END = userstate.TimerSpec('end', userstate.TimeDomain.WATERMARK)

  def process(self, element, w=beam.DoFn.WindowParam,
              seen=beam.DoFn.StateParam(SEEN),
              total=beam.DoFn.StateParam(TOTAL),
              end=beam.DoFn.TimerParam(END)):
    seen.add(element[1])
    total.add(element[1])
    end.set(w.end)

  @userstate.on_timer(END)
  def fire(self, key=beam.DoFn.KeyParam,
           seen=beam.DoFn.StateParam(SEEN),
           total=beam.DoFn.StateParam(TOTAL)):
    yield ('state', key, sorted(seen.read()), total.read())
    seen.clear()
    total.clear()


def _describe(element, ts=beam.DoFn.TimestampParam,
              w=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
  where = ((w.start.micros, w.end.micros)
           if isinstance(w, window.IntervalWindow) else 'global')
  return repr((element, ts.micros // 1000, where, pane.timing, pane.index))


class _WriteOnce(beam.DoFn):
  """Each element to OUT/<sha1 of it>, through a temporary name."""
  def __init__(self, out_dir):
    self.out_dir = out_dir

  def process(self, text):
    directory = os.path.join(self.out_dir, 'out')
    os.makedirs(directory, exist_ok=True)
    name = hashlib.sha1(text.encode('utf-8')).hexdigest()
    tmp = os.path.join(directory, f'.{name}.{os.getpid()}.tmp')
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(tmp, os.path.join(directory, name))


def build(p, out_dir, kill=False, source='teststream', stall=None):
  sdf = source == 'sdf'
  events = sdf_events(p) if sdf else p | test_stream()
  if kill:
    events = events | 'Kill' >> beam.ParDo(
        _KillDriver(out_dir, SDF_KILL_AT if sdf else KILL_AT))
  if stall:
    events = events | 'Stall' >> beam.ParDo(
        _StallOnce(stall, SDF_KILL_AT if sdf else KILL_AT))
  if sdf:
    windowed = events | beam.WindowInto(window.FixedWindows(20))
  else:
    windowed = events | beam.WindowInto(
        window.FixedWindows(20),
        trigger=trigger.AfterWatermark(
            early=trigger.AfterCount(2), late=trigger.AfterCount(1)),
        accumulation_mode=trigger.AccumulationMode.ACCUMULATING,
        allowed_lateness=30)
  _ = (events | 'Windows' >> beam.WindowInto(window.FixedWindows(20))
       | beam.Map(repr)
       | fileio.WriteToFiles(
           path=os.path.join(out_dir, 'files'), shards=1,
           file_naming=fileio.destination_prefix_naming()))
  sums = windowed | beam.CombinePerKey(sum)
  state = windowed | beam.ParDo(_SumAtWindowEnd())
  return ((sums, state) | beam.Flatten() | beam.Map(_describe)
          | beam.ParDo(_WriteOnce(out_dir)))


def build_sums(p, out_dir):
  """The job-server restart tests' shorter job: the unbounded splittable
  read (``--source=sdf``) into the windowed sums (keyed trigger state
  across micro-batches), into the idempotent sink; no file sink, no
  stateful DoFn (each stage costs every micro-batch: with it the job took
  60 s instead of 36 s on a loaded 2-core machine), no kill."""
  return (sdf_events(p) | beam.WindowInto(window.FixedWindows(20))
          | beam.CombinePerKey(sum) | beam.Map(_describe)
          | beam.ParDo(_WriteOnce(out_dir)))


def read_output(out_dir):
  directory = os.path.join(out_dir, 'out')
  return sorted(
      open(os.path.join(directory, name), encoding='utf-8').read()
      for name in os.listdir(directory) if not name.startswith('.'))


def read_files(out_dir):
  """The file sink's finished files: destination and window -> the sorted
  lines of its files. How many files a window gets (the names' -NNNNN-of-
  NNNNN) is how many bundles wrote to it, which is the runner's business;
  a line written twice or lost shows either way."""
  directory = os.path.join(out_dir, 'files')
  found = {}
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      with open(path, encoding='utf-8') as f:
        window = re.sub(r'-\d{5}-of-\d{5}$', '', name)
        found.setdefault(window, []).extend(f.read().splitlines())
  return {window: sorted(lines) for window, lines in found.items()}


def main(argv):
  out_dir, checkpoint = argv[1], argv[2]
  kill = '--kill-mid-batch' in argv
  source = 'sdf' if '--source=sdf' in argv else 'teststream'
  stall = next((a.split('=', 1)[1] for a in argv if a.startswith('--stall=')),
               None)
  logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
  with open(os.path.join(out_dir, 'driver.pid'), 'w', encoding='utf-8') as f:
    f.write(str(os.getpid()))
  # Other flags are pipeline options (a cluster's master, Spark settings).
  extra = [a for a in argv[3:] if a != '--kill-mid-batch' and
           not a.startswith(('--source=', '--stall='))]
  if source == 'sdf':
    extra.append(f'--max_records_per_batch={SDF_BUDGET}')
  if not any(a.startswith('--spark_master_url') for a in extra):
    extra.append('--spark_master_url=local[2]')
  options = PipelineOptions([
      '--streaming', '--allow_unsafe_triggers',
      f'--checkpoint_location={checkpoint}'] + extra)
  with beam.Pipeline('beam_pyspark.PySparkRunner', options=options) as p:
    build(p, out_dir, kill, source, stall)


if __name__ == '__main__':
  main(sys.argv)
