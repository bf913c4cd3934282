"""Fused stages as people know them: by their Beam transforms.

The status page's graph, PySparkRunner's summary and Spark's UI (job
descriptions and call sites, spark.translate) name a stage the same way.
"""

from __future__ import annotations

from typing import Iterable

from beam_pyspark.planning.plan import StagePlan

# Transforms named in a stage's label (Spark's UI shows a line of it).
LABEL_TRANSFORMS = 3


def user_transform_names(names: Iterable[str]) -> list[str]:
  """A stage's Beam transforms, without fusion's reads and writes of
  buffers (``ref_PCollection_.../Read``, ``.../Group/Write``)."""
  kept = []
  for name in names:
    if name.startswith('ref_PCollection_') and name.endswith(('/Read', '/Write')):
      continue
    if name.endswith(('/Group/Read', '/Group/Write')):
      continue
    kept.append(name)
  return kept


def stage_label(index: int, stage: StagePlan) -> str:
  """'Beam stage 3: Split, PairWithOne, GroupAndSum, ... (+2)': the
  stage's number as the status page counts them, and its first transforms."""
  names = user_transform_names(stage.transform_names)
  shown = ', '.join(names[:LABEL_TRANSFORMS])
  if len(names) > LABEL_TRANSFORMS:
    shown += f', ... (+{len(names) - LABEL_TRANSFORMS})'
  kind = {'read': ' (split source)', 'reshuffle': ' (reshuffle)',
          'teststream': ' (TestStream)'}.get(stage.kind, '')
  return f'Beam stage {index + 1}{kind}: {shown or stage.name}'
