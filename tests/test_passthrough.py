"""Leaf transforms that expanded to nothing (Java's, in expanded transforms)
leave the tree before validation and fusion (planning.passthrough)."""

from __future__ import annotations

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.planning import check_supported
from beam_pyspark.planning.passthrough import without_pass_through_leaves

PAR_DO = common_urns.primitives.PAR_DO.urn


def _pipeline() -> beam_runner_api_pb2.Pipeline:
  """Python's Map making rows, then a Java composite 'Sql' whose parts
  are, as Beam SQL expands: a source of the input PCollection (no input,
  no URN; its one part converts nothing), and a ParDo."""
  p = beam_runner_api_pb2.Pipeline()
  c = p.components
  c.environments['py'].urn = 'beam:env:embedded_python:v1'
  c.environments['java'].urn = common_urns.environments.PROCESS.urn
  c.environments['java'].payload = beam_runner_api_pb2.ProcessPayload(
      command='python -m beam_pyspark.boot java').SerializeToString()
  for pcoll in ('impulse', 'rows', 'out'):
    c.pcollections[pcoll].coder_id = 'bytes'
  c.coders['bytes'].spec.urn = common_urns.coders.BYTES.urn

  def add(tid, urn='', inputs=None, outputs=None, parts=(), env=''):
    t = c.transforms[tid]
    t.unique_name = tid
    t.spec.urn = urn
    t.inputs.update(inputs or {})
    t.outputs.update(outputs or {})
    t.subtransforms.extend(parts)
    t.environment_id = env
    return t

  add('Impulse', common_urns.primitives.IMPULSE.urn, outputs={'o': 'impulse'})
  add('Map', PAR_DO, {'i': 'impulse'}, {'o': 'rows'}, env='py')
  add('Sql/Source/Convert', inputs={'i': 'rows'}, outputs={'o': 'rows'})
  add('Sql/Source', outputs={'o': 'rows'}, parts=['Sql/Source/Convert'])
  add('Sql/Calc', PAR_DO, {'i': 'rows'}, {'o': 'out'}, env='java')
  add('Sql', inputs={'i': 'rows'}, outputs={'o': 'out'},
      parts=['Sql/Source', 'Sql/Calc'])
  p.root_transform_ids.extend(['Impulse', 'Map', 'Sql'])
  return p


def test_nothing_to_remove_returns_the_pipeline_itself():
  p = _pipeline()
  del p.components.transforms['Sql/Source/Convert']
  del p.components.transforms['Sql/Source']
  del p.components.transforms['Sql'].subtransforms[0]
  assert without_pass_through_leaves(p) is p


def test_pass_through_leaves_and_the_composites_they_empty_go():
  p = _pipeline()
  cleaned = without_pass_through_leaves(p)
  transforms = cleaned.components.transforms
  assert 'Sql/Source/Convert' not in transforms
  assert 'Sql/Source' not in transforms  # emptied, and made nothing
  assert list(transforms['Sql'].subtransforms) == ['Sql/Calc']
  assert 'Sql/Source' in p.components.transforms  # a copy was changed
  check_supported(cleaned)


def test_a_leaf_with_no_urn_that_makes_a_pcollection_is_still_refused():
  p = _pipeline()
  p.components.pcollections['mystery'].coder_id = 'bytes'
  t = p.components.transforms['Sql/Source/Convert']
  t.outputs['o'] = 'mystery'
  cleaned = without_pass_through_leaves(p)
  assert 'Sql/Source/Convert' in cleaned.components.transforms
  try:
    check_supported(cleaned)
  except Exception as exn:  # pylint: disable=broad-except
    assert 'Sql/Source/Convert' in str(exn)
    assert 'neither a runner primitive' in str(exn)
  else:
    raise AssertionError('a leaf making a PCollection with no URN passed')
