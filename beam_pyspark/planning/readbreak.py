"""A streaming job's unbounded splittable reads hand their output over
(a fusion phase).

A live restriction is one task on one core (``PeriodicImpulse`` is a single
restriction), and fused with the read, every step after it runs in that
task too: the read's consumers (a ``Map``, window assignment, a lifted
combine's precombine, the shuffle's encoding) wait for the one core the
read holds. Put after ``expand_sdf``, this phase gives an unbounded
splittable ParDo's output a runner Reshuffle (``KNOWN_RUNNER_URNS``: a
repartition over the job's partitions), so fusion starts a stage there and
its consumers run in as many tasks as there are partitions, on the fast
path where they may (``worker.fastpath``).

Beam's runners do the same where a source's output is worth spreading
(Dataflow's ``Reshuffle`` after ``Read``; Flink's rebalance after an
unbounded source). Nothing of Beam's semantics moves: a Reshuffle keeps
elements, timestamps, windows and panes, and the watermark passes through
it unchanged.
"""

from __future__ import annotations

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr

# The name of the Reshuffle this phase adds ends so: its stage deals the
# read's chunks whole (``spreads_chunks``).
SUFFIX = '/Spread'
_PROCESS = common_urns.sdf_components.PROCESS_SIZED_ELEMENTS_AND_RESTRICTIONS.urn
_RESHUFFLE = common_urns.composites.RESHUFFLE.urn
_UNBOUNDED = beam_runner_api_pb2.IsBounded.UNBOUNDED


def spreads_chunks(transform_names) -> bool:
  """Whether a reshuffle stage is this phase's: it may deal whole chunks
  over the partitions rather than elements (a read's bundle outputs its
  elements in chunks of thousands; decoding each element to deal it was a
  seventh of a streaming count's worker CPU). Beam's Reshuffle promises
  no particular spread."""
  return any(n.endswith(SUFFIX) for n in transform_names)


def break_unbounded_reads(stages, context):
  """Each unbounded splittable ParDo with one output, then a Reshuffle of
  that output (its consumers read the Reshuffle's)."""
  components = context.components
  for stage in stages:
    yield stage
    if len(stage.transforms) != 1:
      continue
    transform = stage.transforms[0]  # the one in components.transforms
    if transform.spec.urn != _PROCESS or len(transform.outputs) != 1:
      continue
    (tag, pcoll_id), = transform.outputs.items()
    if components.pcollections[pcoll_id].is_bounded != _UNBOUNDED:
      continue
    read_id = tr.unique_name(components.pcollections, pcoll_id + '/read')
    read = components.pcollections[read_id]
    read.CopyFrom(components.pcollections[pcoll_id])
    read.unique_name = read_id
    transform.outputs[tag] = read_id
    name = transform.unique_name + SUFFIX
    transform_id = tr.unique_name(components.transforms, name)
    reshuffle = components.transforms[transform_id]
    reshuffle.CopyFrom(beam_runner_api_pb2.PTransform(
        unique_name=name,
        spec=beam_runner_api_pb2.FunctionSpec(urn=_RESHUFFLE),
        inputs={'input': read_id},
        outputs={'output': pcoll_id}))
    yield tr.Stage(name, [reshuffle],
                   downstream_side_inputs=stage.downstream_side_inputs,
                   must_follow=stage.must_follow, parent=stage.name,
                   environment=stage.environment)
