"""Clients of older Beam versions submitting to the job server (issue 43).

Beam's own WordCount, run by Beam's own PortableRunner client of an older
apache-beam (a virtualenv of its own, made by `make sdk-python-versions`,
which `make test` runs), against a real job server of ours:

- LOOPBACK: the client's own harness runs the stages; exact output.
- its default environment (Beam's Docker image of its version): refused at
  Prepare, naming both versions and what works; the embedded harness, which
  is our Beam, would fail to unpickle the client's functions.
- ``=versioned``: a harness of the client's version (boot.python, from the
  same virtualenv, found as the executor's cache); exact output.

An older Beam Java client (sdks/java-old, `make sdk-java-old`): Beam
2.48.0's own Java WordCount through its own PortableRunner, in its default
environment (Docker, which the job server maps to the PROCESS boot of the
client's staged harness); exact output, its own DirectRunner's.

The versions' functions (planning.versions, planning.environments) have
unit tests below too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import subprocess
import sys

import apache_beam
import pytest
from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.boot import common
from beam_pyspark.boot import java as java_boot
from beam_pyspark.boot import python as python_boot
from beam_pyspark.planning import versions
from beam_pyspark.planning.environments import EnvironmentOverride
from beam_pyspark.planning.environments import apply_overrides
import java_sdk
from jobserver_process import JobServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where `make sdk-python-versions` made them: the harnesses' own cache.
HARNESSES = python_boot.harnesses_dir()
SAMPLE = os.path.join(ROOT, 'examples', 'data', 'sample.txt')
# Kept in step with the Makefile's OLD_BEAM_VERSIONS.
OLD_VERSIONS = ('2.61.0', '2.66.0')
DOCKER = common_urns.environments.DOCKER.urn


def _docker(image: str) -> beam_runner_api_pb2.Environment:
  return beam_runner_api_pb2.Environment(
      urn=DOCKER, payload=beam_runner_api_pb2.DockerPayload(
          container_image=image).SerializeToString())


def test_versions_from_images_and_capabilities():
  assert versions.image_version('apache/beam_python3.11_sdk:2.61.0') == (
      '2.61.0')
  assert versions.image_version(
      'docker.io/apache/beam_java17_sdk:2.70.0@sha256:ab') == '2.70.0'
  assert versions.image_version('my/image:1') is None
  assert versions.image_python('apache/beam_python3.12_sdk:2.61.0') == '3.12'
  # A custom image: the version comes from the sdk_base capability, which
  # Beam's SDKs list whatever the environment (LOOPBACK's too).
  env = _docker('registry/mine:latest')
  env.capabilities.append(
      versions.SDK_BASE + 'apache/beam_python3.11_sdk:2.61.0')
  assert versions.environment_version(env) == '2.61.0'
  assert versions.same_minor('2.77.1', '2.77.0')
  assert not versions.same_minor('2.61.0', '2.77.0')


def test_another_python_version_is_refused_or_runs_versioned():
  ours = f'apache/beam_python3.11_sdk:{apache_beam.__version__}'
  pipeline = beam_runner_api_pb2.Pipeline()
  envs = pipeline.components.environments
  envs['ours'].CopyFrom(_docker(ours))
  envs['old'].CopyFrom(_docker('apache/beam_python3.11_sdk:2.61.0'))
  envs['java'].CopyFrom(_docker('apache/beam_java17_sdk:2.62.0'))
  before = pipeline.SerializeToString()
  with pytest.raises(ValueError) as info:
    apply_overrides(pipeline, [])
  text = str(info.value)
  assert "'old'" in text and '2.61.0' in text and apache_beam.__version__ in (
      text) and 'LOOPBACK' in text and '=versioned' in text
  assert "'ours'" not in text and "'java'" not in text
  # Opted in: ours embedded, the other one booted at its version, Java as
  # before (its boot runs the client's own staged harness).
  pipeline = beam_runner_api_pb2.Pipeline.FromString(before)
  envs = pipeline.components.environments
  apply_overrides(pipeline, [EnvironmentOverride.parse(
      'apache/beam_python*_sdk*=versioned')])
  assert envs['ours'].urn == python_urns.EMBEDDED_PYTHON
  assert beam_runner_api_pb2.ProcessPayload.FromString(
      envs['old'].payload).command == (
          'python -m beam_pyspark.boot python --beam_version=2.61.0')
  assert beam_runner_api_pb2.ProcessPayload.FromString(
      envs['java'].payload).command == 'python -m beam_pyspark.boot java'
  # A client of another Python than ours: its harness runs on ours, said.
  pipeline = beam_runner_api_pb2.Pipeline()
  pipeline.components.environments['py'].CopyFrom(
      _docker('apache/beam_python3.99_sdk:2.61.0'))
  notes = apply_overrides(pipeline, [EnvironmentOverride.parse(
      'apache/beam_python*_sdk*=versioned')])
  assert any('is Python 3.99' in n for n in notes), notes
  # An explicit "embedded" is the user's word: kept, with a warning.
  pipeline = beam_runner_api_pb2.Pipeline.FromString(before)
  notes = apply_overrides(pipeline, [EnvironmentOverride.parse(
      'apache/beam_python*_sdk*=embedded')])
  assert any('may fail to unpickle' in n for n in notes), notes


def test_executors_ship_only_their_beam_versions_python_files(tmp_path):
  """A Python environment of another Beam version (LOOPBACK's, the
  client's own; =versioned's) gets its files through its own harness: the
  executors' Beam would load 2.61's main session with dill, or install a
  requirements file that pins 2.61."""
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  from beam_pyspark.spark.dependencies import collect_dependencies  # pylint: disable=import-outside-toplevel
  components = beam_runner_api_pb2.Components()
  for env_id, version in (('ours', apache_beam.__version__),
                          ('old', '2.61.0')):
    (tmp_path / f'{env_id}.whl').write_bytes(env_id.encode())
    env = components.environments[env_id]
    env.urn = common_urns.environments.EXTERNAL.urn
    env.capabilities.append(
        f'{versions.SDK_BASE}apache/beam_python3.11_sdk:{version}')
    env.dependencies.append(beam_runner_api_pb2.ArtifactInformation(
        type_urn=common_urns.artifact_types.FILE.urn,
        type_payload=beam_runner_api_pb2.ArtifactFilePayload(
            path=str(tmp_path / f'{env_id}.whl')).SerializeToString(),
        role_urn=common_urns.artifact_roles.STAGING_TO.urn,
        role_payload=beam_runner_api_pb2.ArtifactStagingToRolePayload(
            staged_name=f'{env_id}.whl').SerializeToString()))
    components.transforms[f't-{env_id}'].environment_id = env_id
  logged = []
  found = collect_dependencies(
      SimpleNamespace(components=components.SerializeToString()),
      str(tmp_path), logged.append)
  assert [f.name for f, _ in found] == ['ours.whl']
  assert any("'old' is Beam 2.61.0" in line for line in logged), logged


def _boot_context(tmp_path, staged_names, extra=()):
  staged = tmp_path / 'staged'
  staged.mkdir(exist_ok=True)
  artifacts = []
  for name in staged_names:
    (staged / name).write_bytes(b'x')
    artifacts.append(common.RetrievedArtifact(
        str(staged / name), name, beam_runner_api_pb2.ArtifactInformation()))
  return common.BootContext(
      worker_id='worker-7', provision_endpoint='localhost:1',
      control_endpoint='localhost:2', artifact_endpoint='localhost:3',
      logging_endpoint='localhost:4', semi_persist_dir=str(tmp_path),
      info=beam_provision_api_pb2.ProvisionInfo(
          runner_capabilities=['beam:protocol:x:v1']),
      artifacts=artifacts, extra=list(extra))


def test_python_boot_runs_its_versions_harness_without_our_beam(
    tmp_path, monkeypatch):
  monkeypatch.setenv('PYTHONPATH', '/our/beam')
  root = tmp_path / 'harnesses'
  venv = python_boot.venv_dir('2.61.0', str(root))
  os.makedirs(venv)
  # A virtualenv counts once its stamp is there: none is made again.
  open(os.path.join(venv, python_boot.STAMP), 'w').close()
  monkeypatch.setenv(python_boot.ENV_HARNESSES, str(root))
  ctx = _boot_context(tmp_path, ['pickled_main_session'],
                      ['--beam_version=2.61.0'])
  argv, env = python_boot.command(ctx)
  assert argv == [os.path.join(venv, 'bin', 'python'), '-m',
                  'apache_beam.runners.worker.sdk_worker_main']
  assert 'PYTHONPATH' not in env  # nothing staged to install
  assert env['SEMI_PERSISTENT_DIRECTORY'] == str(tmp_path)
  assert env['CONTROL_API_SERVICE_DESCRIPTOR'] == 'url: "localhost:2"\n'
  assert env['RUNNER_CAPABILITIES'] == 'beam:protocol:x:v1'
  with pytest.raises(common.BootError, match='not a Beam version'):
    python_boot.ensure_venv('2.61; rm -rf /', str(root))


def test_java_boot_refuses_a_named_harness_of_another_version(
    tmp_path, monkeypatch):
  monkeypatch.delenv(java_boot.ENV_HARNESS_CLASSPATH, raising=False)
  harness = tmp_path / 'harness'
  harness.mkdir()
  (harness / 'beam-sdks-java-harness-2.70.0.jar').write_bytes(b'jar')
  # As Java's PortableRunner stages it: a hash after the version.
  ctx = _boot_context(tmp_path, ['app.jar', 'beam-sdks-java-core-2.62.0-'
                                 'kRxqBXvaIOU-9WWp.jar'],
                      [f'--harness_classpath={harness}'])
  with pytest.raises(common.BootError) as info:
    java_boot.command(ctx)
  assert '2.70.0' in str(info.value) and '2.62.0' in str(info.value)
  (harness / 'beam-sdks-java-harness-2.70.0.jar').unlink()
  (harness / 'beam-sdks-java-harness-2.62.0.jar').write_bytes(b'jar')
  argv, _ = java_boot.command(ctx)
  assert argv[-1] == java_boot.MAIN_CLASS
  # The client's own staged harness is its own version: never refused.
  staged = _boot_context(tmp_path, [
      'beam-sdks-java-core-2.62.0-a.jar', 'beam-sdks-java-harness-2.62.0-b.jar',
      'jamm-0.4.0.jar'])
  assert java_boot.command(staged)[0][-1] == java_boot.MAIN_CLASS


def test_java_boot_gives_a_harness_before_2_50_its_options_in_a_variable(
    tmp_path, monkeypatch):
  """FnHarness reads PIPELINE_OPTIONS_FILE since Beam 2.50.0; 2.48's reads
  only PIPELINE_OPTIONS and failed at start with 'argument "content" is
  null' (every stage of Beam 2.48.0's WordCount in its default
  environment)."""
  monkeypatch.delenv(java_boot.ENV_HARNESS_CLASSPATH, raising=False)
  monkeypatch.setenv('PIPELINE_OPTIONS', '{"stale": true}')
  old = _boot_context(tmp_path, [
      'beam-sdks-java-core-2.48.0-a.jar', 'beam-sdks-java-harness-2.48.0-b.jar'])
  old.info.pipeline_options.update({'options': {'jobName': 'old'}})
  _, env = java_boot.command(old)
  with open(env['PIPELINE_OPTIONS_FILE'], encoding='utf-8') as f:
    assert env['PIPELINE_OPTIONS'] == f.read()
  assert '"jobName": "old"' in env['PIPELINE_OPTIONS']
  new = _boot_context(tmp_path, [
      'beam-sdks-java-core-2.50.0-a.jar', 'beam-sdks-java-harness-2.50.0-b.jar'])
  _, env = java_boot.command(new)
  assert 'PIPELINE_OPTIONS' not in env and 'PIPELINE_OPTIONS_FILE' in env
  # Over Linux's limit of one variable, an old harness cannot get them.
  old.info.pipeline_options.update({'big': 'x' * 200_000})
  with pytest.raises(common.BootError) as info:
    java_boot.command(old)
  assert '2.48.0' in str(info.value) and '2.50' in str(info.value)


def expected_counts() -> list[str]:
  """What Beam's WordCount writes for the sample: its own regex."""
  with open(SAMPLE, encoding='utf-8') as f:
    words = re.findall(r"[\w\']+", f.read(), re.UNICODE)
  return sorted(f'{w}: {n}' for w, n in collections.Counter(words).items())


def old_python(version: str) -> str:
  python = python_boot.venv_python(python_boot.venv_dir(version, HARNESSES))
  if not os.path.exists(os.path.join(
      python_boot.venv_dir(version, HARNESSES), python_boot.STAMP)):
    pytest.fail(f'No virtualenv with apache-beam=={version} at {python}: '
                'run `make sdk-python-versions` (make test does).')
  return python


def wordcount(version: str, server, out, *args: str
              ) -> subprocess.CompletedProcess:
  """Beam's WordCount, as the old version ships it, from its virtualenv:
  its own Beam only (our PYTHONPATH would put ours first)."""
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  return subprocess.run(
      [old_python(version), '-m', 'apache_beam.examples.wordcount',
       '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
       f'--input={SAMPLE}', f'--output={out}/counts', *args],
      env=env, capture_output=True, text=True, timeout=300, check=False)


def counts(out) -> list[str]:
  lines = []
  for name in sorted(os.listdir(out)):
    if name.startswith('counts'):
      with open(os.path.join(out, name), encoding='utf-8') as f:
        lines.extend(f.read().splitlines())
  return sorted(lines)


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  # The versioned harnesses come from the set-up's virtualenvs: the
  # executor's cache, already filled (boot.python would install there).
  # No warm-up: it also warms streaming, minutes of CPU at a busy CI's
  # load, taken from these jobs; the refusals, first, need no Spark.
  s = JobServerProcess(
      tmp_path_factory.mktemp('skew') / 'artifacts',
      env={python_boot.ENV_HARNESSES: HARNESSES})
  yield s
  s.stop()


@pytest.mark.parametrize('version', OLD_VERSIONS)
def test_an_older_clients_default_environment_is_refused_at_prepare(
    server, tmp_path, version):
  done = wordcount(version, server, tmp_path)
  assert done.returncode != 0
  # The client shows the job server's refusal: both versions, what works.
  assert 'INVALID_ARGUMENT' in done.stderr, done.stderr[-5000:]
  refusal = done.stderr[done.stderr.index('INVALID_ARGUMENT'):]
  assert f'Beam Python {version}' in refusal
  assert f'runs Beam {apache_beam.__version__}' in refusal
  assert 'LOOPBACK' in refusal and '=versioned' in refusal
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize('version', OLD_VERSIONS)
def test_an_older_client_on_loopback_runs_exactly(server, tmp_path, version):
  done = wordcount(version, server, tmp_path, '--environment_type=LOOPBACK')
  assert done.returncode == 0, done.stderr[-5000:]
  assert counts(tmp_path) == expected_counts()
  # Its saved main session is its own harness's: the executors' Beam
  # does not load it (2.61's needs dill, which ours lacks).
  assert f'is Beam {version}: its harness' in done.stderr, done.stderr[-5000:]
  assert "No module named 'dill'" not in server.log()


def test_an_older_clients_default_environment_runs_versioned(
    server, tmp_path):
  done = wordcount(OLD_VERSIONS[0], server, tmp_path,
                   '--environment_override=apache/beam_python*_sdk*=versioned')
  assert done.returncode == 0, done.stderr[-5000:] + server.log()[-5000:]
  assert counts(tmp_path) == expected_counts()


def test_an_older_java_client_runs_in_its_default_environment(
    server, tmp_path):
  """Beam 2.48.0's Java WordCount with no environment option: its
  environment is Docker, apache/beam_java17_sdk:2.48.0, which the job
  server maps to the PROCESS boot; the boot runs FnHarness from the jars
  the client staged, its own version's, so the pipeline runs unchanged and
  writes what 2.48's own DirectRunner writes. (The Python client's
  refusal does not apply: no harness of ours runs Java.) Before the boot
  gave a harness before 2.50 its options in PIPELINE_OPTIONS, every stage
  failed: 'argument "content" is null'."""
  old_cp = java_sdk.classpath(java_sdk.OLD_CLASSPATH_FILE)
  version = java_sdk.beam_version(old_cp)
  assert not versions.same_minor(
      version, java_sdk.beam_version(java_sdk.classpath())), version

  def wordcount_java(name, *args):
    out = tmp_path / name
    out.mkdir()
    java_sdk.run_java(
        'org.apache.beam.examples.WordCount',
        [f'--inputFile={SAMPLE}', f'--output={out}/counts', *args],
        str(tmp_path / f'{name}.log'), java_classpath=old_cp)
    return counts(out)

  # The reference alongside: most of either's time is a JVM's start.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    direct = pool.submit(wordcount_java, 'direct', '--runner=DirectRunner')
    portable = pool.submit(
        wordcount_java, 'portable', '--runner=PortableRunner',
        f'--jobEndpoint={server.job_endpoint}')
    direct, portable = direct.result(), portable.result()
  assert len(direct) > 50 and all(': ' in c for c in direct), direct[:5]
  assert portable == direct
  # The harness that ran is the client's own version's, booted by us (the
  # module's other harnesses are Python's).
  with open(server.log_path, encoding='utf-8', errors='replace') as f:
    boots = [line for line in f if 'Starting the SDK harness' in line
             and line.rstrip().endswith(java_boot.MAIN_CLASS)]
  assert boots and all(f'/beam-sdks-java-harness-{version}-' in line
                       for line in boots), boots[:1] or server.log()[-5000:]
