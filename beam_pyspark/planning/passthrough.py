"""Leaf transforms that do nothing: composites that expanded to no part.

Beam's Java SDK translates a composite whose expansion returns its input
unchanged (``Convert.to`` a type the rows already have, ``Group``'s
``ToKvs/toRow`` when the key is already a row: Beam SQL makes both) as a
transform with no URN, no subtransforms and its input PCollection as its
output (or, with no input, a PCollection another transform makes). Nothing runs for it, and Beam's Java runners leave it out of their
primitives (``QueryablePipeline``); here it reached validation as a leaf
"neither a runner primitive nor assigned to an SDK environment". Such a
transform is removed from the tree before validation and fusion; a leaf
with no URN that makes a PCollection of its own stays, and is refused.
"""

from __future__ import annotations

from apache_beam.portability.api import beam_runner_api_pb2


def _is_empty(transform: beam_runner_api_pb2.PTransform) -> bool:
  return not transform.spec.urn and not transform.subtransforms


def pass_through_leaves(pipeline: beam_runner_api_pb2.Pipeline) -> set:
  """Ids of the leaves with no URN that make no PCollection: each output
  is one of their inputs, or made by a leaf that runs (Beam SQL's
  ``BeamIOSourceRel`` of the input PCollection has no input and outputs
  the PCollection it reads)."""
  transforms = pipeline.components.transforms
  made_by_runnable_leaves = {
      pcoll
      for transform in transforms.values()
      if not transform.subtransforms and not _is_empty(transform)
      for pcoll in transform.outputs.values()
  }
  result = set()
  for tid, transform in transforms.items():
    if not _is_empty(transform):
      continue
    inputs = set(transform.inputs.values())
    if all(pcoll in inputs or pcoll in made_by_runnable_leaves
           for pcoll in transform.outputs.values()):
      result.add(tid)
  return result


def without_pass_through_leaves(
    pipeline: beam_runner_api_pb2.Pipeline) -> beam_runner_api_pb2.Pipeline:
  """The pipeline (itself when there is nothing to remove, else a copy)
  without its pass-through leaves, also gone from their parents' parts; a
  composite left with no part and passing its input through goes too."""
  result = pipeline
  while True:
    dropped = pass_through_leaves(result)
    if not dropped:
      return result
    if result is pipeline:
      result = beam_runner_api_pb2.Pipeline()
      result.CopyFrom(pipeline)
    _remove(result, dropped)


def _remove(pipeline: beam_runner_api_pb2.Pipeline, dropped: set) -> None:
  transforms = pipeline.components.transforms
  for tid in dropped:
    del transforms[tid]
  for transform in transforms.values():
    if any(sub in dropped for sub in transform.subtransforms):
      kept = [sub for sub in transform.subtransforms if sub not in dropped]
      del transform.subtransforms[:]
      transform.subtransforms.extend(kept)
  kept_roots = [t for t in pipeline.root_transform_ids if t not in dropped]
  del pipeline.root_transform_ids[:]
  pipeline.root_transform_ids.extend(kept_roots)
