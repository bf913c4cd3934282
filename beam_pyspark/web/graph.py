"""A job's fused stages as an SVG graph, drawn on the server.

Plain data in (``Graph``: stages, the Beam transforms each holds, and the
buffers between them), SVG text out: no JavaScript, no CDN, nothing the
page must fetch. The layout is a layered DAG: each stage's layer is its
longest path from a source, and within a layer stages are ordered by the
mean position of their producers (one barycentre pass, enough for Beam's
mostly linear pipelines). Edges carry the element counts the caller knows.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Optional

from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning.names import user_transform_names  # noqa: F401 (re-exported)
from beam_pyspark.planning.sdks import describe_environment

NODE_WIDTH = 260
LINE_HEIGHT = 15
LAYER_GAP = 70
NODE_GAP = 30
MAX_TRANSFORMS_SHOWN = 6
MARGIN = 20


@dataclasses.dataclass
class Node:
  node_id: str
  title: str
  kind: str  # 'sdk', 'read', 'reshuffle'
  transforms: list[str]
  status: str = ''  # e.g. 'tasks 3/4'


@dataclasses.dataclass
class Edge:
  source: str
  target: str
  buffer: str  # what flows: a PCollection or a GroupByKey's shuffle
  side_input: bool = False
  label: str = ''


@dataclasses.dataclass
class Graph:
  nodes: list[Node]
  edges: list[Edge]


def buffer_pcollection(buffer_id: bytes) -> Optional[str]:
  """The PCollection a materialized buffer holds (None for shuffles)."""
  if buffer_id == IMPULSE_BUFFER:
    return None
  kind, name = tr.split_buffer_id(buffer_id)
  return name if kind == 'materialize' else None


def plan_graph(plan: ExecutionPlan,
               element_counts: Optional[dict[str, int]] = None) -> Graph:
  """The stages of a plan and the buffers between them.

  ``element_counts``: PCollection id -> elements (Beam's element_count
  metric), shown on the edges that carry it.
  """
  counts = element_counts or {}
  titles = {'read': ' (split source)', 'reshuffle': ' (reshuffle)'}
  components = beam_runner_api_pb2.Components.FromString(plan.components)

  def title(i, stage):
    if stage.kind == 'sdk':  # where its harness runs, e.g. "java, process"
      return (f'Stage {i + 1} '
              f'({describe_environment(components, stage.environment_id)})')
    return f'Stage {i + 1}{titles.get(stage.kind, "")}'

  nodes = [
      Node(node_id=s.name, title=title(i, s), kind=s.kind,
           transforms=user_transform_names(s.transform_names))
      for i, s in enumerate(plan.stages)
  ]
  producers = plan.producers()
  shuffled = _shuffled_pcollections(plan) if counts else {}
  edges = []
  for stage in plan.stages:
    feeds = [(b, False) for b in stage.inputs.values()] + [
        (si.buffer_id, True) for si in stage.side_inputs]
    for buffer_id, side in feeds:
      for producer in producers.get(buffer_id, ()):
        pcoll = buffer_pcollection(buffer_id)
        kind, name = (('impulse', '') if buffer_id == IMPULSE_BUFFER else
                      tr.split_buffer_id(buffer_id))
        label = ''
        if pcoll is not None and pcoll in counts:
          label = f'{counts[pcoll]:,} elements'
        elif kind == 'group':
          label = 'shuffle'
          if shuffled.get(name) in counts:
            label = f'shuffle, {counts[shuffled[name]]:,} elements'
        edges.append(
            Edge(source=producer.name, target=stage.name,
                 buffer=pcoll or name, side_input=side, label=label))
  return Graph(nodes, edges)


def _shuffled_pcollections(plan: ExecutionPlan) -> dict[str, str]:
  """GroupByKey transform id -> the PCollection it groups (its input)."""
  components = beam_runner_api_pb2.Components.FromString(plan.components)
  result = {}
  for buffer_id in plan.groups:
    _, transform_id = tr.split_buffer_id(buffer_id)
    transform = components.transforms.get(transform_id)
    if transform is not None and len(transform.inputs) == 1:
      result[transform_id] = next(iter(transform.inputs.values()))
  return result


def _layers(graph: Graph) -> list[list[Node]]:
  by_id = {n.node_id: n for n in graph.nodes}
  upstream: dict[str, list[str]] = {n.node_id: [] for n in graph.nodes}
  for e in graph.edges:
    if e.source in by_id and e.target in by_id and e.source != e.target:
      upstream[e.target].append(e.source)
  depth: dict[str, int] = {}

  def layer_of(node_id: str, path: frozenset = frozenset()) -> int:
    if node_id in depth:
      return depth[node_id]
    if node_id in path:  # a cycle cannot come from a plan; draw it anyway
      return 0
    ups = [layer_of(u, path | {node_id}) for u in upstream[node_id]]
    depth[node_id] = 1 + max(ups) if ups else 0
    return depth[node_id]

  for node in graph.nodes:
    layer_of(node.node_id)
  layers: list[list[Node]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
  for node in graph.nodes:
    layers[depth[node.node_id]].append(node)
  position: dict[str, float] = {}
  for layer in layers:
    def centre(node: Node) -> float:
      ups = [position[u] for u in upstream[node.node_id] if u in position]
      return sum(ups) / len(ups) if ups else 0.0
    layer.sort(key=centre)
    for i, node in enumerate(layer):
      position[node.node_id] = float(i)
  return layers


def _node_height(node: Node) -> int:
  lines = 1 + min(len(node.transforms), MAX_TRANSFORMS_SHOWN + 1)
  if node.status:
    lines += 1
  return 12 + lines * LINE_HEIGHT


def _text(x: float, y: float, text: str, cls: str, limit: int = 40) -> str:
  shown = text if len(text) <= limit else text[:limit - 1] + '\u2026'
  return (f'<text x="{x:.0f}" y="{y:.0f}" class="{cls}">'
          f'<title>{html.escape(text)}</title>{html.escape(shown)}</text>')


def render_svg(graph: Graph) -> str:
  """The graph as an SVG document (top to bottom, one row per layer)."""
  layers = _layers(graph)
  layer_of = {n.node_id: i for i, layer in enumerate(layers) for n in layer}
  boxes: dict[str, tuple[float, float, float, float]] = {}
  y = MARGIN
  width = MARGIN
  for layer in layers:
    x = MARGIN
    height = max((_node_height(n) for n in layer), default=0)
    for node in layer:
      boxes[node.node_id] = (x, y, NODE_WIDTH, _node_height(node))
      x += NODE_WIDTH + NODE_GAP
    width = max(width, x + 80)  # room for edges and labels in the gap
    y += height + LAYER_GAP
  total_height = y - LAYER_GAP + MARGIN
  parts = [
      f'<svg xmlns="http://www.w3.org/2000/svg" class="pipeline-graph" '
      f'width="{width:.0f}" height="{total_height:.0f}" '
      f'viewBox="0 0 {width:.0f} {total_height:.0f}">',
      '<style>.stage{fill:#f4f7fb;stroke:#4a6fa5;stroke-width:1.2}'
      '.stage.reshuffle,.stage.read{fill:#fbf6ec;stroke:#a5804a}'
      '.title{font:bold 12px sans-serif}.transform{font:11px sans-serif;'
      'fill:#333}.status{font:11px sans-serif;fill:#2a7a2a}'
      '.edge{fill:none;stroke:#777;stroke-width:1.3}'
      '.edge.side{stroke-dasharray:4 3}.label{font:11px sans-serif;'
      'fill:#555}</style>',
      '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" '
      'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
      '<path d="M 0 0 L 10 5 L 0 10 z" fill="#777"/></marker></defs>',
  ]
  for edge in graph.edges:
    if edge.source not in boxes or edge.target not in boxes:
      continue
    sx, sy, sw, sh = boxes[edge.source]
    tx, ty, tw, _ = boxes[edge.target]
    x1, y1 = sx + sw / 2, sy + sh
    x2, y2 = tx + tw / 2, ty
    mid = (y1 + y2) / 2
    if layer_of[edge.target] - layer_of[edge.source] > 1:
      # Past the layers in between: down the gap right of the boxes, so
      # that no stage hides it.
      gap = max(sx + sw, tx + tw) + NODE_GAP / 2
      d = (f'M {x1:.0f} {y1:.0f} Q {gap:.0f} {y1:.0f} {gap:.0f} {mid:.0f} '
           f'Q {gap:.0f} {y2:.0f} {x2:.0f} {y2:.0f}')
      label_x = gap + 4
    else:
      d = (f'M {x1:.0f} {y1:.0f} C {x1:.0f} {mid:.0f} {x2:.0f} {mid:.0f} '
           f'{x2:.0f} {y2:.0f}')
      label_x = (x1 + x2) / 2 + 6
    cls = 'edge side' if edge.side_input else 'edge'
    parts.append(
        f'<path class="{cls}" d="{d}" marker-end="url(#arrow)">'
        f'<title>{html.escape(edge.buffer)}</title></path>')
    label = edge.label + (' (side input)' if edge.side_input else '')
    if label:
      parts.append(_text(label_x, mid, label.strip(), 'label', 48))
  for node in graph.nodes:
    x, y, w, h = boxes[node.node_id]
    parts.append(
        f'<g class="stage-node" data-stage="{html.escape(node.node_id)}">'
        f'<rect class="stage {html.escape(node.kind)}" x="{x:.0f}" '
        f'y="{y:.0f}" width="{w:.0f}" height="{h:.0f}" rx="6"/>')
    line_y = y + 4 + LINE_HEIGHT
    parts.append(_text(x + 8, line_y, node.title, 'title', 38))
    shown = node.transforms[:MAX_TRANSFORMS_SHOWN]
    for name in shown:
      line_y += LINE_HEIGHT
      parts.append(_text(x + 14, line_y, name, 'transform', 40))
    if len(node.transforms) > len(shown):
      line_y += LINE_HEIGHT
      parts.append(_text(
          x + 14, line_y, f'... {len(node.transforms) - len(shown)} more',
          'transform'))
    if node.status:
      line_y += LINE_HEIGHT
      parts.append(_text(x + 8, line_y, node.status, 'status'))
    parts.append('</g>')
  parts.append('</svg>')
  return '\n'.join(parts)


def pipeline_svg(plan: ExecutionPlan,
                 element_counts: Optional[dict[str, int]] = None,
                 statuses: Optional[dict[str, str]] = None) -> str:
  graph = plan_graph(plan, element_counts)
  for node in graph.nodes:
    node.status = (statuses or {}).get(node.node_id, '')
  return render_svg(graph)
