"""Options the runner refuses or hands to workers, and splittable reads with
side inputs.

The first-minutes issues a new user met: a misspelled runner option that
Beam would drop silently, ``--streaming`` on a runner without a streaming
engine (refused; unbounded PCollections run on batch with a warning), and
a splittable DoFn (or any ``apache_beam.dataframe.io`` reader) with a side
input, whose Reshuffle stage had two inputs.
"""

import os

import apache_beam as beam
import pytest
from apache_beam.io.restriction_trackers import OffsetRange
from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.options.value_provider import RuntimeValueProvider
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms.core import RestrictionProvider

from beam_pyspark.errors import InvalidOptionsError
from beam_pyspark.options import misspelled_options
from beam_pyspark.options import runner_options
from conftest import spark_options


# -- options --------------------------------------------------------------------


class _TemplateOptions(PipelineOptions):
  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_value_provider_argument('--template_greeting', type=str)
    parser.add_value_provider_argument(
        '--template_suffix', type=str, default='!')


class _Greet(beam.DoFn):
  def __init__(self, greeting, suffix):
    self.greeting = greeting
    self.suffix = suffix

  def process(self, name, window=beam.DoFn.WindowParam):
    yield (f'{self.greeting.get()} {name}{self.suffix.get()}',
           RuntimeValueProvider.get_value('template_greeting', str, ''),
           type(window).__name__)


def test_templated_options_and_a_window_param_read_in_workers_as_in_beam():
  # Beam's snippets (snippets_test: templated WordCount, ValueProvider
  # info after run, ParDo's DoFn params) on this runner: a ValueProvider
  # option given (static) went into the job's options as an object (JSON
  # failed); one not given (runtime) raised "not called from a runtime
  # context" in workers, where Beam's SDK worker sets the job's options;
  # the fast path handed WindowParam its own IntervalWindow subclass.
  # Beam's pipeline_test (DoFnTest.test_windowed_value_param): a
  # WindowedValueParam after WindowInto(FixedWindows) in the same stage
  # holds FixedWindows.assign's list of IntervalWindows; the fast path
  # handed over its own tuple of its IntervalWindow subclass.
  options = spark_options(template_greeting='hello')
  templated = options.view_as(_TemplateOptions)
  with beam.Pipeline(options=options) as p:
    windowed = (
        p | beam.Create(['ann', 'bob'])
        | beam.Map(lambda x: beam.window.TimestampedValue(x, 10))
        | beam.WindowInto(beam.window.FixedWindows(60)))
    out = windowed | beam.ParDo(_Greet(templated.template_greeting,
                                       templated.template_suffix))
    assert_that(out, equal_to([
        ('hello ann!', 'hello', 'IntervalWindow'),
        ('hello bob!', 'hello', 'IntervalWindow')]))
    held = windowed | beam.Map(
        lambda x, wv=beam.DoFn.WindowedValueParam:
        (wv.value, wv.windows, [type(w).__name__ for w in wv.windows]))
    window = beam.window.IntervalWindow(0, 60)
    assert_that(held, equal_to([
        ('ann', [window], ['IntervalWindow']),
        ('bob', [window], ['IntervalWindow'])]), label='windowed_value')


def test_an_empty_pipeline_runs_to_done_as_on_beams_runners():
  # Beam's YAML tests (yaml_transform_test: circular references, ambiguous
  # names) apply nothing, the YamlTransform raising inside assertRaises in
  # a `with beam.Pipeline()` block: Beam's runners run the empty pipeline to
  # DONE; this runner refused it ("no root transform").
  with beam.Pipeline(options=spark_options()) as p:
    pass
  assert p.result.state == 'DONE'


@pytest.mark.parametrize('flag,right', [
    ('--spark_master=local[2]', 'spark_master_url'),
    ('--spark-master-url=local[2]', 'spark_master_url'),
    ('--spark_parallelsm=3', 'spark_parallelism'),
    ('--group-memory-mb=64', 'group_memory_mb'),
])
def test_misspelled_runner_option_is_refused_with_the_right_spelling(
    flag, right):
  p = beam.Pipeline(options=PipelineOptions(
      ['--runner=beam_pyspark.PySparkRunner', flag]))
  _ = p | beam.Create([1]) | beam.Map(str)
  with pytest.raises(InvalidOptionsError, match=f'did you mean --{right}'):
    p.run()


def test_unrelated_unknown_options_are_left_to_beam():
  assert misspelled_options(['my_app_flag', 'input_topic']) == []


def test_every_runner_option_is_described():
  names = {o.name for o in runner_options()}
  assert names == {
      'spark_master_url', 'spark_conf', 'spark_parallelism', 'drain',
      'split_stragglers_after_secs', 'group_memory_mb', 'status_port',
      'progress', 'checkpoint_location', 'max_records_per_batch',
      'max_bytes_per_batch', 'max_read_secs', 'no_fast_path',
      'environment_override', 'spark_remote', 'checkpoint_store_timeout_secs'}
  assert all(o.description for o in runner_options())


def test_streaming_flag_runs_a_bounded_pipeline_on_the_streaming_engine(
    caplog):
  # Bounded sources in streaming: one micro-batch with all of their input,
  # then the watermarks go to +inf and every window fires, as in batch.
  with caplog.at_level('INFO', logger='beam_pyspark'):
    with beam.Pipeline(options=spark_options(streaming=True)) as p:
      out = (p | beam.Create([('a', 1), ('b', 2), ('a', 3)])
             | beam.GroupByKey() | beam.MapTuple(lambda k, v: (k, sorted(v))))
      assert_that(out, equal_to([('a', [1, 3]), ('b', [2])]))
  assert any('streaming' in r.getMessage() and 'stages on Spark' in
             r.getMessage() for r in caplog.records)


class _Forever(beam.DoFn):
  """An unbounded-per-element SDF: its output PCollection is unbounded."""
  @beam.DoFn.unbounded_per_element()
  def process(
      self, element,
      tracker=beam.DoFn.RestrictionParam(
          beam.transforms.core.RestrictionProvider())):
    yield element


class _Provider(RestrictionProvider):
  def initial_restriction(self, element):
    return OffsetRange(0, element)

  def create_tracker(self, restriction):
    return OffsetRestrictionTracker(restriction)

  def restriction_size(self, element, restriction):
    return restriction.size()


class _UnboundedCount(beam.DoFn):
  @beam.DoFn.unbounded_per_element()
  def process(self, element,
              tracker=beam.DoFn.RestrictionParam(_Provider())):
    pos = tracker.current_restriction().start
    while tracker.try_claim(pos):
      yield pos
      pos += 1


def test_unbounded_pcollection_runs_until_its_source_stops(caplog):
  # An unbounded PCollection makes the job a streaming one; an unbounded
  # SDF that stops claiming ends, as on Beam's FnApiRunner (Beam's
  # conformance suite runs PeriodicImpulse with a stop time so).
  with caplog.at_level('INFO', logger='beam_pyspark'):
    with beam.Pipeline(options=spark_options()) as p:
      out = p | beam.Create([3]) | 'Endless' >> beam.ParDo(_UnboundedCount())
      assert_that(out, equal_to([0, 1, 2]))
  assert any('streaming' in r.getMessage() and 'stages on Spark' in
             r.getMessage() for r in caplog.records)


def test_unbounded_pcollection_runs_drained():
  # --drain finishes what unbounded sources have claimed: batch is right.
  with beam.Pipeline(options=spark_options(drain=True)) as p:
    out = p | beam.Create([3]) | beam.ParDo(_UnboundedCount())
    assert_that(out, equal_to([0, 1, 2]))


# -- splittable DoFns with side inputs ----------------------------------------


class _OffsetCount(beam.DoFn):
  def process(self, element, offset,
              tracker=beam.DoFn.RestrictionParam(_Provider())):
    pos = tracker.current_restriction().start
    while tracker.try_claim(pos):
      yield (element, pos + offset)
      pos += 1


def test_splittable_dofn_with_a_singleton_side_input():
  with beam.Pipeline(options=spark_options()) as p:
    offset = p | 'Offset' >> beam.Create([100])
    out = (
        p | beam.Create([2, 3])
        | beam.ParDo(_OffsetCount(), beam.pvalue.AsSingleton(offset)))
    assert_that(out, equal_to([(2, 100), (2, 101), (3, 100), (3, 101),
                               (3, 102)]))


def test_dataframe_read_csv_groupby_to_csv(tmp_path):
  # pandas comes with the test extra (beam-pyspark[dataframe]).
  from apache_beam.dataframe.io import read_csv
  src = tmp_path / 'in.csv'
  src.write_text('word,n\na,1\nb,2\na,3\nc,4\nb,5\n')
  out = str(tmp_path / 'out')
  with beam.Pipeline(options=spark_options()) as p:
    df = p | read_csv(str(src))
    df.groupby('word').n.sum().to_csv(out)
  lines = []
  for name in sorted(os.listdir(tmp_path)):
    if name.startswith('out'):
      with open(tmp_path / name, encoding='utf-8') as f:
        lines.extend(l.strip() for l in f if l.strip())
  rows = sorted(l for l in lines if not l.startswith('word'))
  assert rows == ['a,4', 'b,7', 'c,4']


def test_every_stage_comes_after_the_producers_of_what_it_reads():
  # The Reshuffle of a splittable DoFn with a side input was planned before
  # the stage splitting its restrictions on some hash seeds (it read an
  # empty buffer: no output). Checked under several seeds, in subprocesses.
  import subprocess
  import sys
  code = '''
import apache_beam as beam
from apache_beam.transforms import environments
from beam_pyspark.planning import plan_pipeline
import test_options_and_side_inputs as t
p = beam.Pipeline()
offset = p | 'Offset' >> beam.Create([100])
_ = p | beam.Create([2, 3]) | beam.ParDo(
    t._OffsetCount(), beam.pvalue.AsSingleton(offset))
plan = plan_pipeline(p.to_runner_api(
    default_environment=environments.EmbeddedPythonEnvironment.default()))
written = set()
for stage in plan.stages:
  producers = plan.producers()
  for b in list(stage.inputs.values()) + [s.buffer_id for s in stage.side_inputs]:
    assert b not in producers or b in written, (stage.name, b)
  written.update(stage.outputs.values())
print('ok')
'''
  for seed in range(1, 7):
    out = subprocess.run(
        [sys.executable, '-c', code], capture_output=True, text=True,
        cwd=os.path.dirname(__file__), timeout=120,
        env=dict(os.environ, PYTHONHASHSEED=str(seed)))
    assert out.stdout.strip().endswith('ok'), (seed, out.stderr[-2000:])
