"""The status page's pipeline graph: fused stages as SVG, drawn on the server."""

import xml.etree.ElementTree as ET

import apache_beam as beam

from beam_pyspark.planning import plan_pipeline
from beam_pyspark.web.graph import pipeline_svg
from beam_pyspark.web.graph import plan_graph

SVG = '{http://www.w3.org/2000/svg}'


def _plan():
  p = beam.Pipeline()
  side = p | 'Side' >> beam.Create([10])
  _ = (
      p | 'Lines' >> beam.Create(['a b', 'b c'])
      | 'Split' >> beam.FlatMap(str.split)
      | 'Pair' >> beam.Map(lambda w, s: (w, s), beam.pvalue.AsSingleton(side))
      | 'Count' >> beam.CombinePerKey(sum)
      | 'Format' >> beam.Map(str))
  return plan_pipeline(p.to_runner_api())


def test_graph_has_every_stage_and_the_buffers_between_them():
  plan = _plan()
  graph = plan_graph(plan)
  assert [n.node_id for n in graph.nodes] == [s.name for s in plan.stages]
  names = [t for n in graph.nodes for t in n.transforms]
  assert {'Split', 'Pair', 'Count/Precombine', 'Count/Merge', 'Format'} <= set(
      names)
  # Fusion's own reads and writes of buffers are not shown.
  assert not [t for t in names if t.endswith(('/Read', '/Write'))]
  kinds = {(e.side_input, e.label) for e in graph.edges}
  assert (True, '') in kinds  # the side input, dashed
  assert (False, 'shuffle') in kinds  # the GroupByKey of CombinePerKey
  # Every edge joins two stages of the plan, producer before consumer.
  order = {s.name: i for i, s in enumerate(plan.stages)}
  assert all(order[e.source] < order[e.target] for e in graph.edges)


def test_svg_is_well_formed_and_shows_counts_and_statuses():
  plan = _plan()
  graph = plan_graph(plan)
  counted = next(e.buffer for e in graph.edges if not e.side_input and
                 e.label != 'shuffle')
  first = plan.stages[0].name
  svg = pipeline_svg(plan, {counted: 12345}, {first: 'tasks 2/2'})
  root = ET.fromstring(svg)
  assert root.tag == f'{SVG}svg'
  texts = [''.join(t.itertext()) for t in root.iter(f'{SVG}text')]
  assert any('12,345 elements' in t for t in texts)
  assert any('tasks 2/2' in t for t in texts)
  assert any('Split' in t for t in texts)
  groups = [g for g in root.iter(f'{SVG}g') if g.get('data-stage')]
  assert len(groups) == len(plan.stages)
  # Stages of a later layer are drawn below the ones they read from.
  y = {g.get('data-stage'): float(g.find(f'{SVG}rect').get('y'))
       for g in groups}
  for edge in graph.edges:
    assert y[edge.source] < y[edge.target]


def test_names_are_escaped():
  p = beam.Pipeline()
  _ = p | beam.Create([1]) | '<script>alert(1)</script>' >> beam.Map(str)
  svg = pipeline_svg(plan_pipeline(p.to_runner_api()))
  assert '<script>' not in svg
  ET.fromstring(svg)
