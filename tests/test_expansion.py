"""The job server's expansion service, used by a Beam Python pipeline.

External transforms are expanded by the running job-server subprocess on its
--expansion-port (Beam's own ExternalTransform client, real gRPC), and the
expanded pipeline then runs through the same server with Beam's
PortableRunner.
"""

from __future__ import annotations

import glob

import pytest

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability import python_urns
from apache_beam.transforms.external import ExternalTransform
from apache_beam.transforms.fully_qualified_named_transform import (
    PYTHON_FULLY_QUALIFIED_NAMED_TRANSFORM_URN)
from apache_beam.transforms.fully_qualified_named_transform import (
    FullyQualifiedNamedTransform)

from jobserver_process import JobServerProcess

WORDS = ['a', 'b', 'a', 'c', 'a', 'b', 'd']


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  s = JobServerProcess(
      tmp_path_factory.mktemp('expansion') / 'server',
      '--fully-qualified-name-glob', 'apache_beam.transforms.combiners.*')
  yield s
  s.stop()


def by_name(server, name: str, *args) -> ExternalTransform:
  """An external transform our expansion service builds by its name."""
  _, payload = FullyQualifiedNamedTransform(
      name, args, {}).to_runner_api_parameter(None)
  return ExternalTransform(
      PYTHON_FULLY_QUALIFIED_NAMED_TRANSFORM_URN,
      payload.SerializeToString(),
      expansion_service=server.expansion_endpoint)


def test_external_transforms_expand_and_run_on_the_same_server(
    server, tmp_path):
  out = str(tmp_path / 'out' / 'top')
  p = beam.Pipeline(
      options=PipelineOptions([
          '--runner=PortableRunner',
          f'--job_endpoint={server.job_endpoint}',
          f'--environment_type={python_urns.EMBEDDED_PYTHON}',
      ]))
  counts = (
      p
      | beam.Create(WORDS)
      | 'CountExternally' >> by_name(
          server, 'apache_beam.transforms.combiners.Count.PerElement'))
  # An argument crosses to the expansion service too.
  top = (
      counts
      | beam.Map(lambda kv: (kv[1], kv[0]))
      | 'TopExternally' >> by_name(
          server, 'apache_beam.transforms.combiners.Top.Largest', 2))
  _ = (
      top
      | beam.FlatMap(lambda pairs: [f'{w}: {n}' for n, w in pairs])
      | beam.io.WriteToText(out))

  # The expansion happened on the server: the expanded parts are there, in
  # an environment this runner accepts.
  components = p.to_runner_api().components
  expanded = [
      t for t in components.transforms.values()
      if t.unique_name.startswith(('CountExternally/', 'TopExternally/'))
  ]
  names = {t.unique_name.split('/')[0] for t in expanded}
  assert names == {'CountExternally', 'TopExternally'}
  envs = {
      components.environments[t.environment_id].urn
      for t in expanded if t.environment_id
  }
  assert envs == {python_urns.EMBEDDED_PYTHON}

  p.run().wait_until_finish()

  lines = []
  for shard in sorted(glob.glob(out + '*')):
    with open(shard, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  assert sorted(lines) == ['a: 3', 'b: 2']


def test_names_outside_the_glob_are_refused_clearly(server):
  p = beam.Pipeline()
  with pytest.raises(RuntimeError, match='not allowed by filter') as info:
    _ = p | beam.Create([1]) | by_name(server, 'os.system', 'true')
  assert 'os.system' in str(info.value)
