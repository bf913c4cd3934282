"""The streaming engine's watermark graph over a plan's fused stages.

Nodes are the stages (a TestStream's per output tag) and each GroupByKey's
reduce side (named by its buffer); edges are the buffers between them.
The rules that move watermarks over it are ``streaming.watermarks``'
(sans-I/O); this module only says which node is which.
"""

from __future__ import annotations

from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.planning.plan import IMPULSE_BUFFER
from beam_pyspark.planning.plan import ExecutionPlan
from beam_pyspark.planning.plan import StagePlan
from beam_pyspark.streaming import MAX_MICROS
from beam_pyspark.streaming.watermarks import WatermarkGraph


def group_node(buffer_id: bytes) -> str:
  """The node of a GroupByKey's reduce side."""
  return 'gbk:' + buffer_id.decode('utf-8', 'replace')


class StageGraph:
  """A plan's stages as watermark-graph nodes.

  ``sources``: nodes with no input (impulse-fed stages, groups of nothing),
  exhausted after the job's first wave; ``tag_nodes``: a TestStream's
  output tag -> its node, whose watermark the TestStream sets.
  """
  def __init__(self, plan: ExecutionPlan, producers: dict):
    self.plan = plan
    self.producers = producers
    self.graph = WatermarkGraph()
    self.sources: list[str] = []
    self.tag_nodes: dict[str, str] = {}
    self._build()

  def node_of(self, stage: StagePlan, output_id: str) -> str:
    if stage.kind == 'teststream':
      return f'{stage.name}#{stage.output_tags[output_id]}'
    return stage.name

  def written(self, buffer_id: bytes) -> list[str]:
    """The graph's edges of the stages writing ``buffer_id``."""
    return sorted({
        f'{self.node_of(s, out)} -> {buffer_id!r}'
        for s in self.producers.get(buffer_id, ())
        for out, b in s.outputs.items() if b == buffer_id})

  def readers_wait_for(self, buffer_id: bytes) -> list[str]:
    """The graph's edges a reader of ``buffer_id`` waits for."""
    if tr.split_buffer_id(buffer_id)[0] == 'group':
      return [group_node(buffer_id) + ' out']
    return self.written(buffer_id)

  def side_watermarks(self, stage: StagePlan) -> dict:
    """(transform id, tag) -> the watermark of each side input's buffer."""
    return {
        (si.transform_id, si.tag): min(
            (self.graph.pcollection_watermark(e)
             for e in self.readers_wait_for(si.buffer_id)),
            default=MAX_MICROS)
        for si in stage.side_inputs}

  def _build(self) -> None:
    graph = self.graph
    for stage in self.plan.stages:
      if stage.kind == 'teststream':
        for out, tag in stage.output_tags.items():
          node = self.node_of(stage, out)
          if node not in self.tag_nodes.values():
            edges = [
                f'{node} -> {b!r}' for o, b in stage.outputs.items()
                if stage.output_tags[o] == tag]
            graph.add_stage(node, outputs=sorted(set(edges)), source=True)
            self.tag_nodes[tag] = node
        continue
      inputs = [e for b in stage.inputs.values() if b != IMPULSE_BUFFER
                for e in self.readers_wait_for(b)]
      sides = [e for si in stage.side_inputs
               for e in self.readers_wait_for(si.buffer_id)]
      outputs = sorted({f'{stage.name} -> {b!r}'
                        for b in stage.outputs.values()})
      graph.add_stage(stage.name, inputs, outputs, sides, source=not inputs)
      if not inputs:
        self.sources.append(stage.name)
    for buffer_id in self.plan.groups:
      node = group_node(buffer_id)
      inputs = self.written(buffer_id)
      graph.add_stage(node, inputs, [node + ' out'], source=not inputs)
      if not inputs:
        self.sources.append(node)

  def display_names(self) -> dict[str, str]:
    """Each node as people know it: its stage's first Beam transforms (not
    fusion's reads and writes of buffers), or its GroupByKey's name."""
    names = {}
    for stage in self.plan.stages:
      mine = [n for n in stage.transform_names if not n.startswith('ref_')]
      text = ', '.join(mine[:2]) + (', ...' if len(mine) > 2 else '')
      names[stage.name] = text or stage.name
      for out, tag in stage.output_tags.items():
        names[self.node_of(stage, out)] = f'{text} [{tag}]'
    for buffer_id, spec in self.plan.groups.items():
      names[group_node(buffer_id)] = spec.transform_name
    return names
