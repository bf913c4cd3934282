"""Docker environments mapped to processes, worker pools or the embedded
harness (planning.environments): unit tests of the mapping, then pipelines
sent by Beam's PortableRunner with Docker environments to a real job
server, which runs them as the overrides say."""

from __future__ import annotations

import glob
import sys

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.planning import check_supported
from beam_pyspark.planning.environments import EnvironmentOverride
from beam_pyspark.planning.environments import apply_overrides
from beam_pyspark.planning.sdks import describe_environment
from beam_pyspark.errors import UnsupportedPipelineError
from jobserver_process import JobServerProcess

DOCKER = common_urns.environments.DOCKER.urn


def _docker(image: str) -> beam_runner_api_pb2.Environment:
  return beam_runner_api_pb2.Environment(
      urn=DOCKER,
      payload=beam_runner_api_pb2.DockerPayload(
          container_image=image).SerializeToString(),
      capabilities=['beam:coder:bytes:v1'],
      dependencies=[beam_runner_api_pb2.ArtifactInformation(
          type_urn='beam:artifact:type:file:v1')])


def test_override_forms_and_their_errors():
  process = EnvironmentOverride.parse('my/img:*=process:run me --x')
  assert process.urn == common_urns.environments.PROCESS.urn
  assert beam_runner_api_pb2.ProcessPayload.FromString(
      process.payload).command == 'run me --x'
  external = EnvironmentOverride.parse('img=external:localhost:5000')
  assert beam_runner_api_pb2.ExternalPayload.FromString(
      external.payload).endpoint.url == 'localhost:5000'
  assert EnvironmentOverride.parse(
      'img=embedded').urn == python_urns.EMBEDDED_PYTHON
  for bad in ('no-equals', 'img=', 'img=docker:x', 'img=process:',
              'img=embedded:x'):
    with pytest.raises(ValueError, match='override'):
      EnvironmentOverride.parse(bad)


def test_beams_own_images_boot_their_sdks_by_default():
  pipeline = beam_runner_api_pb2.Pipeline()
  envs = pipeline.components.environments
  for sdk, image in (
      ('java', 'apache/beam_java17_sdk:2.62.0'),
      ('go', 'apache/beam_go_sdk:2.62.0'),
      # As Beam's TypeScript SDK names it.
      ('typescript', 'docker.io/apache/beam_typescript_sdk:2.49.0')):
    envs[sdk].CopyFrom(_docker(image))
  apply_overrides(pipeline, [])
  for sdk in ('java', 'go', 'typescript'):
    assert envs[sdk].urn == common_urns.environments.PROCESS.urn
    assert beam_runner_api_pb2.ProcessPayload.FromString(
        envs[sdk].payload).command == f'python -m beam_pyspark.boot {sdk}'


def test_environments_are_named_by_their_sdk():
  """The job's messages and the status page name each stage's SDK: from
  the sdk_base capability, else the Docker image or the PROCESS command's
  boot (Beam's TypeScript SDK lists no sdk_base)."""
  def process(command):
    return beam_runner_api_pb2.Environment(
        urn=common_urns.environments.PROCESS.urn,
        payload=beam_runner_api_pb2.ProcessPayload(
            command=command).SerializeToString())
  components = beam_runner_api_pb2.Components()
  envs = components.environments
  envs['ts'].CopyFrom(process('python -m beam_pyspark.boot typescript'))
  envs['ts_image'].CopyFrom(
      _docker('docker.io/apache/beam_typescript_sdk:2.49.0'))
  envs['java'].CopyFrom(process('java -cp x Main'))
  envs['java'].capabilities.append(
      'beam:version:sdk_base:apache/beam_java17_sdk:2.62.0')
  envs['other'].CopyFrom(process('./my-harness'))
  assert describe_environment(components, 'ts') == 'typescript, process'
  assert describe_environment(components, 'ts_image') == 'typescript, docker'
  assert describe_environment(components, 'java') == 'java, process'
  assert describe_environment(components, 'other') == 'unknown SDK, process'


def test_first_matching_override_wins_and_the_rest_stays():
  pipeline = beam_runner_api_pb2.Pipeline()
  envs = pipeline.components.environments
  envs['java'].CopyFrom(_docker('apache/beam_java17_sdk:2.62.0'))
  envs['mine'].CopyFrom(_docker('registry/mine:1'))
  envs['other'].CopyFrom(_docker('somewhere/else:2'))
  anyof = envs['any']
  anyof.urn = common_urns.environments.ANYOF.urn
  anyof.payload = beam_runner_api_pb2.AnyOfEnvironmentPayload(
      environments=[_docker('registry/mine:2')]).SerializeToString()
  notes = apply_overrides(pipeline, [
      EnvironmentOverride.parse('registry/mine:*=external:host:1'),
      EnvironmentOverride.parse('registry/*=process:never'),
  ])
  assert envs['mine'].urn == common_urns.environments.EXTERNAL.urn
  # The defaults: Beam's Java image boots with the runner's Java boot.
  assert beam_runner_api_pb2.ProcessPayload.FromString(
      envs['java'].payload).command == 'python -m beam_pyspark.boot java'
  assert envs['other'].urn == DOCKER
  (member,) = beam_runner_api_pb2.AnyOfEnvironmentPayload.FromString(
      anyof.payload).environments
  assert member.urn == common_urns.environments.EXTERNAL.urn
  # What the environment is besides how it starts is kept.
  assert list(envs['mine'].capabilities) == ['beam:coder:bytes:v1']
  assert len(envs['mine'].dependencies) == 1
  assert len(notes) == 3 and any(
      "'registry/mine:1'" in n and 'host:1' in n for n in notes)
  # The unmatched Docker environment is refused, naming its image and the
  # way out.
  with pytest.raises(UnsupportedPipelineError) as info:
    check_supported(pipeline)
  assert any('somewhere/else:2' in r and '--environment-override' in r
             for r in info.value.reasons)


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  # The job server's own override: an image of "ours" runs in a process
  # with Beam's Python harness.
  s = JobServerProcess(
      tmp_path_factory.mktemp('overrides'), '--environment-override',
      f'example/ours:*=process:{sys.executable} -m '
      'apache_beam.runners.worker.sdk_worker_main')
  yield s
  s.stop()


def _count(options, out, server=None, messages=None):
  p = beam.Pipeline(options=PipelineOptions(options))
  _ = (p | beam.Create(['a b', 'b c', 'b']) | beam.FlatMap(str.split)
       | beam.combiners.Count.PerElement()
       | beam.MapTuple(lambda w, n: f'{w}: {n}')
       | beam.io.WriteToText(out))
  result = p.run()
  assert result.wait_until_finish() == 'DONE'
  if messages is not None:
    stream = server.job_stub.GetMessageStream(
        beam_job_api_pb2.JobMessagesRequest(job_id=result._job_id),
        timeout=30)
    messages.extend(r.message_response.message_text for r in stream
                    if r.HasField('message_response'))
  return sorted(line.strip() for path in glob.glob(out + '*')
                for line in open(path, encoding='utf-8'))


EXPECTED = ['a: 1', 'b: 3', 'c: 1']


def test_beams_python_image_runs_embedded(server, tmp_path):
  # PortableRunner's own default environment is Beam's Docker image.
  messages = []
  assert _count([
      '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
      '--environment_type=DOCKER',
      '--environment_config=apache/beam_python3.11_sdk:2.77.0'],
      str(tmp_path / 'out'), server, messages) == EXPECTED
  assert any('runs as the embedded Python harness' in m for m in messages)
  assert any('(python, embedded)' in m for m in messages), messages


def test_the_servers_and_the_jobs_overrides(server, tmp_path):
  messages = []
  assert _count([
      '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
      '--environment_type=DOCKER', '--environment_config=example/ours:1'],
      str(tmp_path / 'server'), server, messages) == EXPECTED
  assert any('runs as a process' in m and 'sdk_worker_main' in m
             for m in messages), messages
  assert any('(python, process)' in m for m in messages), messages
  # The job's own comes before the server's.
  messages = []
  assert _count([
      '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
      '--environment_type=DOCKER', '--environment_config=example/ours:1',
      '--environment_override=example/*=embedded'],
      str(tmp_path / 'job'), server, messages) == EXPECTED
  assert any('(python, embedded)' in m for m in messages), messages


def test_an_unmapped_image_is_refused_at_prepare(server, tmp_path):
  with pytest.raises(Exception) as info:
    _count([
        '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
        '--environment_type=DOCKER', '--environment_config=nobody/knows:1'],
        str(tmp_path / 'out'))
  text = str(info.value)
  assert 'nobody/knows:1' in text and 'environment-override' in text
