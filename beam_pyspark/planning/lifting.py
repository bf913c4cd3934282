"""Which combines a streaming job lifts (a fusion phase).

Beam's ``lift_combiners`` splits a CombinePerKey into a precombine before
the GroupByKey and a merge after it whenever its trigger allows (it lifts
under ``Always`` and ``AfterCount(1)`` too). In a streaming job two things
are lost by precombining a bundle's elements of a key and window into one
accumulator, and a streaming job keeps them by not lifting:

- the element count a trigger sees: ``Always``, ``AfterCount(n)`` anywhere
  in the trigger count accumulators instead of elements (Prism does not
  lift these either: ``handlecombine.go``, "Disable lifting if there is any
  TriggerElementCount or TriggerAlways");
- the elements' own timestamps: the precombine stamps its accumulator with
  the combined timestamp (``OUTPUT_AT_EARLIEST``: the earliest of the
  bundle), and the trigger driver holds the output watermark only at
  timestamps not behind it; an accumulator stamped behind the watermark
  takes the elements after it out of the hold (Beam's trigger transcript
  ``known_late_data_watermark``: inputs [2, 3, 7, 8] after watermark 5 give
  timestamp 7; lifted, 9). Only ``OUTPUT_AT_END_OF_WINDOW`` is safe.

Such combines run unlifted, as Beam runs any combine it cannot lift: their
GroupByKey, then the combine of the grouped values.
"""

from __future__ import annotations

from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations as tr

from beam_pyspark.planning import readbreak

_EOW = (beam_runner_api_pb2.OutputTime.END_OF_WINDOW,
        beam_runner_api_pb2.OutputTime.UNSPECIFIED)
_COMBINE_PER_KEY = common_urns.composites.COMBINE_PER_KEY.urn
_PRECOMBINE = common_urns.combine_components.COMBINE_PER_KEY_PRECOMBINE.urn
_PAR_DO = common_urns.primitives.PAR_DO.urn


def counts_elements(trigger: beam_runner_api_pb2.Trigger) -> bool:
  """Whether ``trigger`` has an ``Always`` or an element count in it."""
  kind = trigger.WhichOneof('trigger')
  if kind in ('always', 'element_count'):
    return True
  if kind in ('after_all', 'after_any', 'after_each'):
    return any(counts_elements(t)
               for t in getattr(trigger, kind).subtriggers)
  if kind == 'after_end_of_window':
    eow = trigger.after_end_of_window
    return ((eow.HasField('early_firings') and
             counts_elements(eow.early_firings)) or
            (eow.HasField('late_firings') and
             counts_elements(eow.late_firings)))
  if kind == 'or_finally':
    return (counts_elements(trigger.or_finally.main) or
            counts_elements(getattr(trigger.or_finally, 'finally')))
  if kind == 'repeat':
    return counts_elements(trigger.repeat.subtrigger)
  return False


def may_lift_streaming(
    windowing: beam_runner_api_pb2.WindowingStrategy) -> bool:
  """Whether a streaming CombinePerKey over this windowing may be lifted."""
  return (windowing.output_time in _EOW and
          not counts_elements(windowing.trigger))


def unlift_streaming_combines(stages, context):
  """Expands the CombinePerKeys a streaming job must not lift into their
  own subtransforms (as Beam's ``lift_combiners`` expands those it cannot
  lift); ``lift_combiners`` then sees only the others."""
  components = context.components
  for stage in stages:
    transform = tr.only_transform(stage.transforms)
    if transform.spec.urn == _COMBINE_PER_KEY and transform.subtransforms:
      pcoll = components.pcollections[tr.only_element(
          list(transform.inputs.values()))]
      windowing = components.windowing_strategies[pcoll.windowing_strategy_id]
      if not may_lift_streaming(windowing):
        for sub_id in transform.subtransforms:
          sub = components.transforms[sub_id]
          yield tr.Stage(
              sub.unique_name, [sub],
              downstream_side_inputs=stage.downstream_side_inputs,
              must_follow=stage.must_follow, parent=stage.name,
              environment=stage.environment)
        continue
    yield stage


def streaming_phases(phases) -> list:
  """A streaming job's fusion phases: combiners left unpacked, as Beam's
  PortableRunner does for a streaming job (its conformance suite checks),
  only the combines that lose nothing by it lifted, and unbounded
  splittable reads' output spread over the partitions (``readbreak``)."""
  out = []
  for phase in phases:
    if phase is tr.lift_combiners:
      out.append(unlift_streaming_combines)
    if phase is not tr.pack_combiners:
      out.append(phase)
    if phase is tr.expand_sdf:
      out.append(readbreak.break_unbounded_reads)
  return out


def keyed_by_none_only(producers: dict, pcoll_id: str) -> bool:
  """Whether every element of ``pcoll_id`` has the key None: the output of
  CombineGlobally's KeyWithVoid (a DoFn of Beam's known by its URN),
  directly or through its lifted precombine (which keeps keys);
  ``producers``: each PCollection's producing transform in the fused
  stages. A GroupByKey of it has one key, so one reduce partition holds it
  all and any other is an empty task: a batch plan gives it one (not a
  streaming one, whose groups keep their state in their key's partition
  of all of them)."""
  producer = producers.get(pcoll_id)
  if producer is not None and producer.spec.urn == _PRECOMBINE:
    producer = producers.get(tr.only_element(list(producer.inputs.values())))
  if producer is None or producer.spec.urn != _PAR_DO:
    return False
  payload = beam_runner_api_pb2.ParDoPayload.FromString(producer.spec.payload)
  return payload.do_fn.urn == python_urns.KEY_WITH_NONE_DOFN
