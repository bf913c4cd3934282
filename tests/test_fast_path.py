"""The fast path (planning.fastpath, worker.fastpath) against the harness.

Most tests run a planned stage in this process twice, on the SDK harness
(StageRunner) and on the fast path (FastStage), and compare the bytes of
the shuffle records or encoded elements, Beam's element counts, user
metrics and errors; each fallback trigger is tried. A few run pipelines on
local[2] with the fast path on and off.
"""

from __future__ import annotations

import functools
import re

import apache_beam as beam
import pytest
from apache_beam.io import iobase
from apache_beam.io import ReadFromText
from apache_beam.io.range_trackers import OffsetRangeTracker
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms import combiners
from apache_beam.transforms import environments
from apache_beam.transforms import window

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.planning.plan import plan_pipeline
from beam_pyspark.worker import fastpath
from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.runtime import JobRuntime

from conftest import spark_options
from fast_stages import Planned
from fast_stages import run_on_and_off

WORDS = re.compile(r"[\w']+")


def split_words(line):
  return WORDS.findall(line)


def pair_one(word):
  return word, 1


def parse_kv(line):
  key, value = line.split(',')
  return key, int(value)


@pytest.fixture(scope='module')
def text(tmp_path_factory):
  """A text file of about 3 MiB (two splits), words of a 3000-word
  vocabulary, and a ``key,value`` file."""
  d = tmp_path_factory.mktemp('fast')
  words = [f'w{i}' for i in range(3000)]
  path = d / 'words.txt'
  with open(path, 'w', encoding='utf-8') as f:
    for i in range(60_000):
      f.write(' '.join(words[(i * 7 + j * 13) % 3000] for j in range(i % 9))
              + '\n')
  kv = d / 'kv.txt'
  with open(kv, 'w', encoding='utf-8') as f:
    for i in range(20_000):
      f.write(f'k{i % 500},{i}\n')
  return str(path), str(kv)


# -- the same bytes and counts as the harness ---------------------------------


def test_wordcount_map_stage_writes_the_harnesss_records(text):
  words, _ = text
  stage = Planned(lambda p: (
      p | ReadFromText(words) | 'Split' >> beam.FlatMap(split_words)
      | 'Pair' >> beam.Map(pair_one) | 'Count' >> beam.CombinePerKey(sum)))
  assert stage.spec.read_pcoll and stage.compact
  assert [s.kind for s in stage.spec.steps] == ['pardo', 'pardo', 'precombine']
  records, counts, _, error = stage.compare()
  assert error is None and len(records) == 3000
  lines = sum(1 for _ in open(words, encoding='utf-8'))
  assert counts[stage.spec.read_pcoll] == lines


def test_groupbykey_map_stage_writes_the_harnesss_records(text):
  _, kv = text
  stage = Planned(lambda p: (
      p | ReadFromText(kv) | 'Parse' >> beam.Map(parse_kv)
      | beam.GroupByKey()))
  records, _, _, _ = stage.compare()
  assert len(records) == 20_000


@pytest.mark.parametrize('combine', [
    combiners.CountCombineFn(), combiners.MeanCombineFn(), max,
    beam.combiners.ToListCombineFn()])
def test_combines_inlined_or_called_give_beams_accumulators(combine):
  stage = Planned(lambda p: (
      p | beam.Impulse() | beam.FlatMap(lambda _: range(5000))
      | beam.Map(lambda x: (x % 97, x * 0.5)) | beam.CombinePerKey(combine)))
  records, counts, _, _ = stage.compare()
  assert len(records) == 97 and max(counts.values()) == 5000


@pytest.mark.parametrize('combine, kind', [
    (combiners.TopCombineFn(20), 'top'), (combiners.Largest(3), 'top'),
    (combiners.TopCombineFn(4, reverse=True), 'generic'),
    (combiners.TopCombineFn(4, key=abs), 'generic')])
def test_top_inlined_or_called_keeps_beams_heap(combine, kind):
  """Top's heap in the default order, inlined: ties between values equal
  but not alike (3 and 3.0) kept as Beam's add_input keeps them."""
  stage = Planned(lambda p: (
      p | beam.Impulse() | beam.FlatMap(lambda _: range(5000))
      | beam.Map(lambda x: (x % 7, x % 40 if x % 3 else float(x % 40)))
      | beam.CombinePerKey(combine)))
  records, counts, _, _ = stage.compare()
  (call, ) = [c for c in stage.last.instances.calls if c.kind == chains.COMBINE]
  assert call.combine_kind == kind
  assert len(records) == 7 and max(counts.values()) == 5000


def test_typed_keys_and_materialized_output_are_encoded_as_the_harness_does():
  typed = Planned(lambda p: (
      p | beam.Impulse() | beam.FlatMap(lambda _: range(3000))
      | beam.Map(lambda x: (str(x % 10), x)).with_output_types(tuple[str, int])
      | beam.GroupByKey()))
  assert not typed.compact
  typed.compare()
  materialized = Planned(lambda p: (
      p | beam.Impulse() | beam.FlatMap(lambda _: range(3000))
      | beam.Map(lambda x: (x, None)) | beam.Reshuffle()))
  assert not materialized.grouped
  assert len(materialized.compare()[0]) == 3000


class KeyedTally(beam.DoFn):
  """Takes its element's key (a DoFn parameter the loop does not hand
  over): the harness runs it, after the loop."""
  def process(self, kv, key=beam.DoFn.KeyParam):
    Metrics.counter('fast', 'tallied').inc()
    if key == 'boom':
      raise ValueError('tally exploded')
    yield key, len(key)


class Tally(beam.DoFn):
  """A DoFn of the user's own, with a metric: the loop runs it."""
  def process(self, x):
    Metrics.counter('fast', 'tallied').inc()
    if x == 'boom':
      raise ValueError('tally exploded')
    yield x, len(x)


def test_ineligible_stages_say_why(caplog):
  def reasons(build):
    p = beam.Pipeline()
    build(p)
    plan = plan_pipeline(p.to_runner_api(
        default_environment=environments.EmbeddedPythonEnvironment.default()))
    caplog.clear()
    with caplog.at_level('DEBUG', logger='beam_pyspark.worker.fastpath'):
      fastpath.choose(plan.stages, JobRuntime('reasons', plan.components))
    return ' | '.join(r.getMessage() for r in caplog.records)

  def impulse(p, label='Values'):
    return p | label >> beam.Impulse() | f'{label}/Range' >> beam.FlatMap(
        lambda _: [(i, i) for i in range(3)])

  assert "'Tally' takes KeyParam in process" in reasons(
      lambda p: p | beam.Impulse() | beam.Map(lambda x: (x, x))
      | 'Tally' >> beam.ParDo(KeyedTally()) | beam.Reshuffle())
  # A chain up to the DoFn, the harness after it.
  assert ("up to 'Values/Range', the harness after it ('Tally' takes "
          "KeyParam") in reasons(
              lambda p: impulse(p) | 'Tally' >> beam.ParDo(KeyedTally())
              | beam.Reshuffle())
  assert 'reads a multimap side input' in reasons(lambda p: impulse(p) | (
      beam.Map(lambda x, s: x, beam.pvalue.AsMultiMap(
          impulse(p, 'Side') | beam.Map(lambda x: (x, x)))))
                                                  | beam.Reshuffle())
  assert 'merging windows' in reasons(
      lambda p: p | beam.Create([1]) | beam.WindowInto(window.Sessions(10))
      | beam.Map(lambda x: (x, x)) | beam.GroupByKey())
  assert 'of the user\'s own' in reasons(
      lambda p: impulse(p) | beam.Map(lambda x: (x, x))
      | beam.CombinePerKey(lambda vs: sum(vs)))


def join_with(x, names):
  name = names.get(x % 60)
  return [] if name is None else [f'{x}:{name}']


@pytest.mark.parametrize('view', ['dict', 'list', 'singleton'])
def test_side_inputs_are_handed_over_as_their_views(view):
  side = {'dict': [(i, f'n{i}') for i in range(50)],
          'list': [(i, f'n{i}') for i in range(50)],
          'singleton': [{i: f'n{i}' for i in range(50)}]}[view]
  as_view = {'dict': beam.pvalue.AsDict,
             'list': lambda pc: beam.pvalue.AsList(pc),
             'singleton': beam.pvalue.AsSingleton}[view]
  fn = (join_with if view != 'list' else
        lambda x, names: join_with(x, dict(names)))

  def build(p):
    names = p | 'Names' >> beam.Impulse() | 'NameList' >> beam.FlatMap(
        lambda _: [])
    _ = (p | beam.Impulse() | beam.FlatMap(lambda _: range(300))
         | 'Join' >> beam.FlatMap(fn, as_view(names))
         | 'Pair' >> beam.Map(lambda x: (x, None))
         | 'Tally' >> beam.ParDo(KeyedTally()) | beam.GroupByKey())

  stage = Planned(build, label='Join',
                  sides={'side0': side, 'python_side_input0': side})
  assert stage.spec.rest_stage is not None and stage.spec.steps[-1].name == (
      'Pair')
  records, counts, user, error = stage.compare()
  assert error is None and len(records) == 250
  assert list(user.values()) == [250]


def test_a_users_dofn_after_the_chain_fails_as_in_the_harness():
  def build(p):
    _ = (p | beam.Impulse()
         | beam.FlatMap(lambda _: ['a', 'bb', 'boom', 'ccc'])
         | 'Upper' >> beam.Map(lambda x: (x.lower(), 1))
         | 'Tally' >> beam.ParDo(KeyedTally()) | beam.GroupByKey())

  stage = Planned(build, label='Upper')
  assert stage.spec.rest_stage is not None
  error = stage.compare()[3]
  assert error.startswith("tally exploded [while running 'Tally']")


# -- fallbacks ------------------------------------------------------------------


def stamp_from_100(x):
  return window.TimestampedValue(x, 1000 + x) if x >= 100 else x


def tag_from_100(x):
  return [TaggedOutput('other', x)] if x >= 100 else [x]


def count_from_100(x):
  if x >= 100:
    Metrics.counter('fast', 'big').inc()
  return x


def fail_at(limit, x):
  if x == limit:
    raise ValueError(f'bad element {x}')
  return x


def _impulse_then(fn, n=300, output=None):
  def build(p):
    values = (p | beam.Impulse() | beam.FlatMap(lambda _: range(n))
              | 'Suspect' >> beam.Map(fn))
    if output == 'combine':
      _ = (values | beam.Map(lambda x: (x if isinstance(x, int) else 50) % 60)
           | beam.Map(lambda k: (k, k)) | beam.CombinePerKey(sum))
    elif output == 'mixed':
      keyed = beam.Map(lambda x: ((x if isinstance(x, int) else 50) % 60, x))
      _ = values | keyed | beam.CombinePerKey(sum)
    else:
      _ = values | beam.Map(lambda x: (x % 7, x)) | beam.Reshuffle()

  return Planned(build, label='Suspect')


@pytest.mark.parametrize('fn', [stamp_from_100, tag_from_100])
def test_special_outputs_hand_the_rest_to_the_harness(fn):
  suspect = (fn if fn is stamp_from_100 else
             lambda x: tag_from_100(x)[0])  # Map's single output
  stage = _impulse_then(suspect)
  # (A timestamp is carried by the loop; a tag of a single-output Map's
  # is not.)
  elements_, counts, _, error = stage.compare(fallback=fn is tag_from_100)
  assert error is None and counts


def test_a_metric_update_hands_the_rest_to_the_harness():
  stage = _impulse_then(count_from_100)
  _, _, user, error = stage.compare()
  assert error is None
  assert list(user.values()) == [200]


def test_an_error_is_the_harnesss_own():
  stage = _impulse_then(functools.partial(fail_at, 150))
  _, _, _, error = stage.compare(fallback=True)
  assert error.startswith("bad element 150 [while running 'Suspect']")


def test_an_error_after_an_eviction_is_the_harnesss_own(monkeypatch):
  # Evicted accumulators leave the task at once (tiny chunks) before the
  # error: the harness takes the rest of the partition and raises.
  monkeypatch.setattr(chains, 'MAX_KEYS_TINY', 50)
  monkeypatch.setattr(fastpath, 'CHUNK_BYTES', 16)
  stage = _impulse_then(functools.partial(fail_at, 250), output='combine')
  assert stage.compare(fallback=True)[3].startswith("bad element 250 [while running")


def test_a_combine_failing_after_output_left_raises_the_harnesss_error(
    monkeypatch):
  # sum() over the buffer of a key fails once a str joins its ints, inside
  # the table, which the loop cannot undo; evicted accumulators have left
  # the task: the harness runs the partition again (its output dropped)
  # and fails with its own error.
  monkeypatch.setattr(chains, 'MAX_KEYS_TINY', 50)
  monkeypatch.setattr(fastpath, 'CHUNK_BYTES', 16)
  stage = _impulse_then(lambda x: x if x < 290 else 'x', output='mixed')
  error = stage.compare(fallback=True)[3]
  assert 'unsupported operand' in error


class _StampedSource(iobase.BoundedSource):
  """Records as TimestampedValues: the harness re-stamps them."""
  def estimate_size(self):
    return 100

  def get_range_tracker(self, start_position, stop_position):
    return OffsetRangeTracker(start_position or 0,
                              100 if stop_position is None else stop_position)

  def read(self, range_tracker):
    for i in range(range_tracker.start_position(),
                   range_tracker.stop_position()):
      if range_tracker.try_claim(i):
        yield window.TimestampedValue(i, i)

  def split(self, desired_bundle_size, start_position=None,
            stop_position=None):
    yield iobase.SourceBundle(1.0, self, 0, 100)


def test_a_source_of_timestamped_values_runs_on_the_harness():
  stage = Planned(lambda p: (
      p | beam.io.Read(_StampedSource()) | 'Pair' >> beam.Map(
          lambda x: (x % 3, x)) | beam.Reshuffle()))
  elements_, counts, _, _ = stage.compare(fallback=True)
  assert len(elements_) == 100


# -- on Spark, on and off -------------------------------------------------------


def test_wordcount_on_spark_on_and_off(text, tmp_path):
  words, _ = text

  def build(p, out):
    _ = (p | ReadFromText(words) | beam.FlatMap(split_words)
         | beam.Map(pair_one) | beam.CombinePerKey(sum)
         | beam.MapTuple(lambda k, v: f'{k}: {v}')
         | beam.io.WriteToText(out))

  (on, on_counts, _, on_messages), (off, off_counts, _, off_messages) = (
      run_on_and_off(build, tmp_path))
  assert on == off and len(on) == 3000
  assert on_counts == off_counts
  assert any(re.match(r'\d of \d+ fused stages on the fast path', m)
             for m in on_messages), on_messages
  assert not any('fast path' in m for m in off_messages)


def test_create_group_and_metrics_on_spark_on_and_off(tmp_path):
  def build(p, out):
    _ = (p | beam.Create(range(2000)) | beam.Map(count_from_100)
         | beam.Map(lambda x: (x % 10, x)) | beam.GroupByKey()
         | beam.MapTuple(lambda k, vs: f'{k} {sum(vs)}')
         | beam.io.WriteToText(out))

  (on, on_counts, on_user, _), (off, off_counts, off_user, _) = run_on_and_off(
      build, tmp_path)
  assert on == off and len(on) == 10
  assert on_counts == off_counts
  assert on_user == off_user and list(on_user.values()) == [1900]


def test_side_input_join_on_spark_on_and_off(text, tmp_path):
  # The join runs in the loop, WriteToText's writer in the harness after
  # it, in the same task.
  _, kv = text

  def build(p, out):
    names = p | 'Names' >> beam.Create([(i, f'n{i}') for i in range(50)])
    _ = (p | ReadFromText(kv) | beam.Map(parse_kv)
         | beam.FlatMap(lambda kv, names: [f'{kv[0]} {names[kv[1] % 60]}']
                        if kv[1] % 60 in names else [],
                        beam.pvalue.AsDict(names))
         | beam.io.WriteToText(out))

  (on, on_counts, _, on_messages), (off, off_counts, _, _) = run_on_and_off(
      build, tmp_path)
  assert on == off and len(on) == 16_670
  assert on_counts == off_counts
  assert any(re.match(r'[2-9] of \d+ fused stages on the fast path', m)
             for m in on_messages), on_messages


def test_a_file_writer_handing_over_midway_writes_each_line_once(tmp_path):
  # WriteToText's writer runs in the loop; the metric update from element
  # 100 on hands the rest to the harness: the loop's file is closed and
  # kept, the harness writes the rest in files of its own.
  def build(p, out):
    _ = (p | beam.Create(range(3000)) | beam.Map(count_from_100)
         | beam.Map(str) | beam.io.WriteToText(out))

  (on, on_counts, on_user, _), (off, off_counts, off_user, _) = run_on_and_off(
      build, tmp_path)
  assert on == off == sorted(str(i) for i in range(3000))
  assert on_user == off_user and list(on_user.values()) == [2900]
  # (The fast path's bundles differ from the harness's: only the counts of
  # the PCollections the elements go through are compared.)
  assert {k: v for k, v in on_counts.items() if v >= 100} == {
      k: v for k, v in off_counts.items() if v >= 100}


def test_a_users_error_is_the_same_on_and_off():
  texts = []
  for flags in ({}, {'no_fast_path': True}):
    with pytest.raises(ValueError) as raised:
      with beam.Pipeline(options=spark_options(**flags)) as p:
        _ = (p | beam.Create(range(6))
             | 'CheckStock' >> beam.Map(functools.partial(fail_at, 3))
             | beam.Map(lambda x: (x, 1)) | beam.CombinePerKey(sum))
    assert isinstance(raised.value, PipelineExecutionError)
    texts.append(str(raised.value))
  for text_ in texts:
    assert text_.startswith("bad element 3 [while running 'CheckStock']")
    assert 'fail_at' in text_ and 'test_fast_path.py' in text_
