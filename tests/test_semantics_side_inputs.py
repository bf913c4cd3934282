"""Side inputs on local[2]: every view, and windowed side inputs."""

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pvalue import AsDict
from apache_beam.pvalue import AsIter
from apache_beam.pvalue import AsList
from apache_beam.pvalue import AsMultiMap
from apache_beam.pvalue import AsSingleton
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import window

from conftest import Observe
from conftest import sort_all

SEC = 1_000_000


def options(**extra):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'
  ] + [f'--{k}={v}' for k, v in extra.items()])


def main_input(p, n=50):
  # Reshuffled, so that the main input is spread over partitions.
  return p | 'Main' >> beam.Create(range(n)) | 'Spread' >> beam.Reshuffle()


def test_side_input_as_iter(collect):
  def build(p):
    side = p | 'Side' >> beam.Create([1, 2, 3, 4])
    return main_input(p) | beam.Map(
        lambda x, s: (x, sorted(s), sum(s)), AsIter(side))

  expected = sort_all((x, [1, 2, 3, 4], 10) for x in range(50))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_side_input_as_list_with_duplicates(collect):
  def build(p):
    side = p | 'Side' >> beam.Create(['b', 'a', 'b', 'c'])
    return main_input(p, 20) | beam.Map(
        lambda x, s: (x, sorted(s), len(s)), AsList(side))

  expected = sort_all((x, ['a', 'b', 'b', 'c'], 4) for x in range(20))
  assert collect.spark(build) == expected


def test_side_input_as_dict(collect):
  def build(p):
    side = p | 'Side' >> beam.Create([(i, f'name{i}') for i in range(0, 50, 5)])
    return main_input(p) | beam.Map(
        lambda x, d: (x, d.get(x, None), len(d)), AsDict(side))

  expected = sort_all(
      (x, f'name{x}' if x % 5 == 0 else None, 10) for x in range(50))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_side_input_as_singleton_computed_in_pipeline(collect):
  def build(p):
    total = (
        p | 'Side' >> beam.Create(range(1, 11))
        | 'Sum' >> beam.CombineGlobally(sum))
    return main_input(p, 10) | beam.Map(
        lambda x, t: (x, t, x * t), AsSingleton(total))

  expected = sort_all((x, 55, x * 55) for x in range(10))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_side_input_as_singleton_default_for_empty(collect):
  def build(p):
    empty = p | 'Side' >> beam.Create([])
    return main_input(p, 5) | beam.Map(
        lambda x, s: (x, s), AsSingleton(empty, default_value='none'))

  assert collect.spark(build) == sort_all((x, 'none') for x in range(5))


def test_side_input_as_multimap(collect):
  def build(p):
    side = p | 'Side' >> beam.Create([('even', 0), ('odd', 1), ('even', 2),
                                       ('even', 4), ('odd', 3), ('odd', 3)])

    def lookup(x, mm):
      key = 'even' if x % 2 == 0 else 'odd'
      return (x, sorted(mm[key]), sorted(mm['odd' if key == 'even' else
                                            'even'])[:1], list(mm['none']))

    return main_input(p, 10) | beam.Map(lookup, AsMultiMap(side))

  expected = sort_all(
      (x, [0, 2, 4] if x % 2 == 0 else [1, 3, 3], [1] if x % 2 == 0 else [0],
       [])
      for x in range(10))
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_several_side_inputs_on_one_pardo_and_one_side_input_read_twice():
  with beam.Pipeline(options=options()) as p:
    words = p | 'Words' >> beam.Create(['x', 'y'])
    table = p | 'Table' >> beam.Create([('x', 1), ('y', 2)])
    main = main_input(p, 6)
    first = main | 'First' >> beam.Map(
        lambda n, ws, t: (n, tuple(sorted(ws)), sum(t.values())),
        AsList(words), AsDict(table))
    second = main | 'Second' >> beam.Map(
        lambda n, ws: (n, len(list(ws))), AsIter(words))
    assert_that(
        first,
        equal_to([(n, ('x', 'y'), 3) for n in range(6)]),
        label='CheckFirst')
    assert_that(second, equal_to([(n, 2) for n in range(6)]),
                label='CheckSecond')


def _stamp(pcoll, label):
  return pcoll | label >> beam.Map(
      lambda e: window.TimestampedValue(e, e[1]))


def test_windowed_side_input_each_window_sees_its_own_values(collect):
  # (name, event time in seconds)
  main = [(f'm{t}', t) for t in (1, 5, 12, 18, 25, 47)]
  side = [(f's{t}', t) for t in (2, 3, 14, 21, 29, 33)]

  def build(p):
    side_pc = (
        _stamp(p | 'Side' >> beam.Create(side), 'StampSide')
        | 'WindowSide' >> beam.WindowInto(window.FixedWindows(10))
        | 'SideName' >> beam.Map(lambda e: e[0]))
    return (
        _stamp(p | 'MainIn' >> beam.Create(main), 'StampMain')
        | 'WindowMain' >> beam.WindowInto(window.FixedWindows(10))
        | 'Spread' >> beam.Reshuffle()
        | beam.Map(lambda e, s: (e[0], sorted(s)), AsList(side_pc))
        | beam.ParDo(Observe()))

  def side_of(t):
    start = t - t % 10
    return sorted(n for n, st in side if start <= st < start + 10)

  expected = sort_all(((name, side_of(t)), t * SEC,
                       ('interval', (t - t % 10) * SEC,
                        (t - t % 10 + 10) * SEC)) for name, t in main)
  # The window [40, 50) has no side values at all.
  assert (('m47', []), 47 * SEC, ('interval', 40 * SEC, 50 * SEC)) in expected
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_windowed_side_input_singleton_per_window(collect):
  def build(p):
    counts = (
        _stamp(p | 'Side' >> beam.Create([('s', t) for t in range(0, 30, 2)]),
               'StampSide')
        | 'WindowSide' >> beam.WindowInto(window.FixedWindows(10))
        | 'One' >> beam.Map(lambda e: 1)
        | 'Count' >> beam.CombineGlobally(sum).without_defaults())
    return (
        _stamp(p | 'MainIn' >> beam.Create([('m', t) for t in (1, 11, 21)]),
               'StampMain')
        | 'WindowMain' >> beam.WindowInto(window.FixedWindows(10))
        | beam.Map(lambda e, c: (e[1], c), AsSingleton(counts)))

  expected = [(1, 5), (11, 5), (21, 5)]
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_side_input_in_larger_windows_is_mapped(collect):
  # Main in 10 s windows, side in 20 s windows: main window [10, 20) reads
  # side window [0, 20).
  main = [(f'm{t}', t) for t in (3, 15, 22, 38)]
  side = [(f's{t}', t) for t in (1, 19, 20, 39, 45)]

  def build(p):
    side_pc = (
        _stamp(p | 'Side' >> beam.Create(side), 'StampSide')
        | 'WindowSide' >> beam.WindowInto(window.FixedWindows(20))
        | 'SideName' >> beam.Map(lambda e: e[0]))
    return (
        _stamp(p | 'MainIn' >> beam.Create(main), 'StampMain')
        | 'WindowMain' >> beam.WindowInto(window.FixedWindows(10))
        | beam.Map(lambda e, s: (e[0], sorted(s)), AsIter(side_pc)))

  expected = sort_all([
      ('m3', ['s1', 's19']),
      ('m15', ['s1', 's19']),
      ('m22', ['s20', 's39']),
      ('m38', ['s20', 's39']),
  ])
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_global_side_input_for_windowed_main_input(collect):
  def build(p):
    side = p | 'Side' >> beam.Create(['g1', 'g2'])
    return (
        p | 'MainIn' >> beam.Create([1, 15, 27])
        | beam.Map(lambda t: window.TimestampedValue(t, t))
        | beam.WindowInto(window.FixedWindows(10))
        | beam.Map(lambda t, s: (t, sorted(s)), AsList(side)))

  expected = [(1, ['g1', 'g2']), (15, ['g1', 'g2']), (27, ['g1', 'g2'])]
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_windowed_side_input_as_dict_and_multimap(collect):
  def build(p):
    side = (
        p | 'Side' >> beam.Create([('k', 1, 1), ('k', 2, 2), ('j', 3, 11),
                                   ('k', 4, 12)])
        | 'StampSide' >> beam.Map(
            lambda e: window.TimestampedValue((e[0], e[1]), e[2]))
        | 'WindowSide' >> beam.WindowInto(window.FixedWindows(10)))
    return (
        p | 'MainIn' >> beam.Create([5, 15, 25])
        | beam.Map(lambda t: window.TimestampedValue(t, t))
        | beam.WindowInto(window.FixedWindows(10))
        | beam.Map(
            lambda t, mm: (t, {k: sorted(mm[k]) for k in 'jkz' if mm[k]}),
            AsMultiMap(side)))

  expected = sort_all([
      (5, {'k': [1, 2]}),
      (15, {'j': [3], 'k': [4]}),
      (25, {}),
  ])
  actual, reference = collect.both(build)
  assert sort_all(reference) == expected
  assert sort_all(actual) == expected


def test_pcollection_as_main_and_side_input_of_the_same_pardo(collect):
  def build(p):
    pc = p | 'Values' >> beam.Create(range(8))
    return pc | beam.Map(lambda x, s: (x, sum(s) - x), AsIter(pc))

  expected = [(x, 28 - x) for x in range(8)]
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected


def test_side_input_read_from_text_files(collect, tmp_path):
  for i in range(3):
    (tmp_path / f'side-{i}.txt').write_text(f'line{i}a\nline{i}b\n')
  pattern = str(tmp_path / 'side-*.txt')

  def build(p):
    side = p | beam.io.ReadFromText(pattern)
    return main_input(p, 3) | beam.Map(lambda x, s: (x, sorted(s)), AsList(side))

  lines = sorted(f'line{i}{c}' for i in range(3) for c in 'ab')
  assert collect.spark(build) == [(x, lines) for x in range(3)]


def test_empty_side_inputs(collect):
  def build(p):
    empty = p | 'Empty' >> beam.Create([])
    kvs = p | 'EmptyKV' >> beam.Create([]) | beam.Map(lambda x: (x, x))
    return main_input(p, 3) | beam.Map(
        lambda x, i, l, d: (x, list(i), list(l), dict(d)), AsIter(empty),
        AsList(empty), AsDict(kvs))

  expected = [(x, [], [], {}) for x in range(3)]
  actual, reference = collect.both(build)
  assert reference == expected
  assert actual == expected
