"""Staged dependencies without Spark: what the driver ships (spark and
sdk_dependencies) and how an executor's Python installs and isolates them
(worker.setup.dependencies), with real pip installs of wheels built here, offline.

The cluster tests (test_cluster.py) run the same code inside executors.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from types import SimpleNamespace

import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.sdk_dependencies import StagedDependencies
from beam_pyspark.spark.dependencies import collect_dependencies
from beam_pyspark.worker.setup import dependencies as deps
from packages import module_source
from packages import write_wheel


@pytest.fixture(autouse=True)
def offline_pip(monkeypatch):
  """pip as on an executor with no index: staged files only."""
  for key in list(os.environ):
    if key.startswith('PIP_'):
      monkeypatch.delenv(key)
  monkeypatch.setenv('PIP_CONFIG_FILE', os.devnull)
  monkeypatch.setenv('PIP_NO_INDEX', '1')
  yield
  deps.activate(None)


def wheel_set(directory, name, version, requires=()):
  path = write_wheel(
      directory, name, version, module_source(version), requires=requires)
  wheel = os.path.basename(path)
  with open(path, 'rb') as f:
    contents = {wheel: f.read(), deps.EXTRA_PACKAGES_FILE: f'{wheel}\n'.encode()}
  return deps.dependency_set(contents), contents


def test_switching_jobs_imports_each_jobs_own_version(tmp_path):
  root = str(tmp_path / 'root')
  (tmp_path / 'v1').mkdir()
  (tmp_path / 'v2').mkdir()
  one, one_files = wheel_set(tmp_path / 'v1', 'isodep', '1.0')
  two, two_files = wheel_set(tmp_path / 'v2', 'isodep', '2.0')
  assert one.key != two.key

  deps.activate(one, deps.fetch_from(one_files), root)
  import isodep
  assert isodep.VERSION == '1.0'
  assert isodep.__file__.startswith(root + os.sep)

  deps.activate(two, deps.fetch_from(two_files), root)
  assert 'isodep' not in sys.modules
  import isodep  # pylint: disable=reimported
  assert isodep.VERSION == '2.0'

  # Back to the first: installed already, its version again.
  deps.activate(one, lambda *_: pytest.fail('fetched again'), root)
  import isodep  # pylint: disable=reimported
  assert isodep.VERSION == '1.0'

  # A job without dependencies sees neither.
  deps.activate(None)
  assert 'isodep' not in sys.modules
  assert not any(p.startswith(root) for p in sys.path)
  with pytest.raises(ImportError):
    import isodep  # pylint: disable=reimported,unused-import


def test_what_the_executor_has_is_not_installed_again(tmp_path):
  """A package requiring Beam and pyspark installs offline: the executor's
  own satisfy them, and nothing but the package lands in the job's venv."""
  staged, files = wheel_set(
      tmp_path, 'needsbeam', '1.0',
      requires=['apache-beam', 'pyspark>=4', 'protobuf'])
  installed = deps.install(staged, deps.fetch_from(files), str(tmp_path / 'root'))
  site = sorted(
      n for n in os.listdir(installed.site_dir) if not n.startswith('_'))
  assert site == ['needsbeam', 'needsbeam-1.0.dist-info']


def _install_in_another_process(args):
  root, directory = args
  staged, files = wheel_set(directory, 'racedep', '1.0')
  installed = deps.install(staged, deps.fetch_from(files), root)
  marker = os.stat(os.path.join(installed.directory, '.complete'))
  return marker.st_ino, marker.st_mtime_ns


def test_concurrent_installs_on_one_host_install_once(tmp_path):
  root = str(tmp_path / 'root')
  dirs = []
  for i in range(3):
    (tmp_path / str(i)).mkdir()
    dirs.append((root, str(tmp_path / str(i))))
  ctx = multiprocessing.get_context('spawn')
  with ctx.Pool(3) as pool:
    markers = pool.map(_install_in_another_process, dirs)
  # One install: every process found the same completed one.
  assert len(set(markers)) == 1
  assert len([n for n in os.listdir(root) if not n.endswith('.lock')]) == 1


def test_a_damaged_transfer_is_refused_and_not_trusted_later(tmp_path):
  root = str(tmp_path / 'root')
  staged, files = wheel_set(tmp_path, 'okdep', '1.0')
  damaged = dict(files)
  damaged[deps.EXTRA_PACKAGES_FILE] = b'something else\n'
  with pytest.raises(PipelineExecutionError, match='intact'):
    deps.install(staged, deps.fetch_from(damaged), root)
  installed = deps.install(staged, deps.fetch_from(files), root)
  assert os.listdir(installed.site_dir)


def test_unsafe_or_missing_names_are_refused(tmp_path):
  with pytest.raises(PipelineExecutionError, match='plain file name'):
    deps.dependency_set({'../escape.whl': b''})
  staged = deps.dependency_set({deps.EXTRA_PACKAGES_FILE: b'absent.whl\n'})
  with pytest.raises(PipelineExecutionError, match='absent.whl'):
    deps.install(
        staged, deps.fetch_from({deps.EXTRA_PACKAGES_FILE: b'absent.whl\n'}),
        str(tmp_path / 'root'))


# -- the driver's side --------------------------------------------------------


def _file(path, name):
  return beam_runner_api_pb2.ArtifactInformation(
      type_urn=common_urns.artifact_types.FILE.urn,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path=str(path)).SerializeToString(),
      role_urn=common_urns.artifact_roles.STAGING_TO.urn,
      role_payload=beam_runner_api_pb2.ArtifactStagingToRolePayload(
          staged_name=name).SerializeToString())


def _plan(environments):
  components = beam_runner_api_pb2.Components()
  for env_id, artifacts in environments.items():
    components.environments[env_id].urn = python_urns.EMBEDDED_PYTHON
    components.environments[env_id].dependencies.extend(artifacts)
    components.transforms[f't-{env_id}'].environment_id = env_id
  # An environment no transform runs in is not shipped.
  components.environments['unused'].dependencies.extend(
      [_file('/nonexistent', 'unused.whl')])
  return SimpleNamespace(components=components.SerializeToString())


def test_driver_reads_what_executors_need_and_skips_the_rest(tmp_path):
  for name in ('a.whl', 'requirements.txt', 'sdk.tar', 'freeze.txt',
               'pip-reqs.txt'):
    (tmp_path / name).write_bytes(name.encode())
  pip_reqs = beam_runner_api_pb2.ArtifactInformation(
      type_urn=common_urns.artifact_types.FILE.urn,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path=str(tmp_path / 'pip-reqs.txt')).SerializeToString(),
      role_urn=common_urns.artifact_roles.PIP_REQUIREMENTS_FILE.urn)
  embedded = beam_runner_api_pb2.ArtifactInformation(
      type_urn=common_urns.artifact_types.EMBEDDED.urn,
      type_payload=beam_runner_api_pb2.EmbeddedFilePayload(
          data=b'inline').SerializeToString(),
      role_urn=common_urns.artifact_roles.STAGING_TO.urn,
      role_payload=beam_runner_api_pb2.ArtifactStagingToRolePayload(
          staged_name='inline.txt').SerializeToString())
  plan = _plan({
      'env': [
          _file(tmp_path / 'a.whl', 'a.whl'),
          _file(tmp_path / 'requirements.txt', 'requirements.txt'),
          _file(tmp_path / 'sdk.tar', deps.STAGED_SDK_SOURCES_FILE),
          _file(tmp_path / 'freeze.txt', deps.SUBMISSION_ENV_DEPENDENCIES_FILE),
          pip_reqs, embedded
      ],
      # The same file from another environment is fine.
      'other': [_file(tmp_path / 'a.whl', 'a.whl')],
  })
  messages = []
  scratch = tmp_path / 'scratch'
  scratch.mkdir()
  found = collect_dependencies(plan, str(scratch), messages.append)
  contents = {f.name: open(path, 'rb').read() for f, path in found}
  digest_name = [n for n in contents if n not in (
      'a.whl', 'requirements.txt', 'inline.txt')]
  assert sorted(contents) == sorted(
      ['a.whl', 'requirements.txt', 'inline.txt'] + digest_name)
  assert len(digest_name) == 1 and len(digest_name[0]) == 64
  assert contents['a.whl'] == b'a.whl'
  assert contents['inline.txt'] == b'inline'
  assert {f.name for f, _ in found if f.requirements} == {
      'requirements.txt', digest_name[0]}
  # Files are served where they lie; embedded data is written out.
  paths = {f.name: path for f, path in found}
  assert paths['a.whl'] == str(tmp_path / 'a.whl')
  assert os.path.dirname(paths['inline.txt']) == str(scratch)
  for f, path in found:
    assert f.size == os.path.getsize(path)
  assert any(deps.STAGED_SDK_SOURCES_FILE in m for m in messages)


def test_another_sdks_artifacts_are_not_shipped_to_pythons(tmp_path):
  # A Java environment's jars (and Go's worker binary) reach its harness
  # over the Fn API (boot/), not the executors' Python.
  (tmp_path / 'a.whl').write_bytes(b'a')
  plan = _plan({'py': [_file(tmp_path / 'a.whl', 'a.whl')],
                'java': [_file('/nonexistent/app.bin', 'app.bin')]})
  components = beam_runner_api_pb2.Components.FromString(plan.components)
  java = components.environments['java']
  java.urn = common_urns.environments.PROCESS.urn
  java.capabilities.append(
      'beam:version:sdk_base:apache/beam_java17_sdk:2.62.0')
  plan.components = components.SerializeToString()
  found = collect_dependencies(plan, str(tmp_path))
  assert [f.name for f, _ in found] == ['a.whl']


def test_two_environments_disagreeing_on_a_file_are_refused(tmp_path):
  (tmp_path / 'one').write_bytes(b'1')
  (tmp_path / 'two').write_bytes(b'2')
  plan = _plan({'env1': [_file(tmp_path / 'one', 'requirements.txt')],
                'env2': [_file(tmp_path / 'two', 'requirements.txt')]})
  with pytest.raises(PipelineExecutionError, match="'requirements.txt'"):
    collect_dependencies(plan, str(tmp_path))


def test_unreadable_artifact_names_itself(tmp_path):
  plan = _plan({'env': [_file(tmp_path / 'gone.whl', 'gone.whl')]})
  with pytest.raises(PipelineExecutionError, match="'gone.whl'"):
    collect_dependencies(plan, str(tmp_path))


def test_runner_stages_like_portable_runner_and_cleans_up(tmp_path):
  wheel = write_wheel(tmp_path, 'stagedep', '1.0', module_source('1.0'))
  staged = StagedDependencies(
      PipelineOptions(['--extra_package', wheel, '--save_main_session']))
  names = set()
  for artifact in staged.artifacts:
    names.add(
        beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(
            artifact.role_payload).staged_name)
  assert names == {
      os.path.basename(wheel), deps.EXTRA_PACKAGES_FILE,
      deps.PICKLED_MAIN_SESSION_FILE}

  pipeline = beam_runner_api_pb2.Pipeline()
  pipeline.components.environments['py'].urn = python_urns.EMBEDDED_PYTHON
  pipeline.components.environments['other'].urn = 'beam:env:docker:v1'
  with_deps = staged.add_to(pipeline)
  assert len(with_deps.components.environments['py'].dependencies) == 3
  assert not with_deps.components.environments['other'].dependencies
  assert not pipeline.components.environments['py'].dependencies

  class Execution:
    pass

  owner = Execution()
  staged.remove_after(owner)
  assert os.path.isdir(staged.directory)
  del owner
  gc.collect()
  assert not os.path.exists(staged.directory)


def test_runner_with_nothing_to_stage_leaves_nothing(tmp_path):
  staged = StagedDependencies(PipelineOptions([]))
  assert staged.artifacts == []
  assert not os.path.exists(staged.directory)


def test_files_to_stage_are_importable_as_beam_workers_make_them(tmp_path):
  """Beam's sdk_worker_main puts the staged directory on sys.path."""
  staged = deps.dependency_set({'stagedhelper.py': b'ANSWER = 42\n'})
  deps.activate(
      staged, deps.fetch_from({'stagedhelper.py': b'ANSWER = 42\n'}),
      str(tmp_path / 'root'))
  import stagedhelper
  assert stagedhelper.ANSWER == 42
  deps.activate(None)
  assert 'stagedhelper' not in sys.modules


def test_a_package_that_does_not_build_fails_with_pips_words(tmp_path):
  import io
  import tarfile
  sdist = tmp_path / 'brokendep-1.0.tar.gz'
  files = {
      'brokendep-1.0/setup.py': b'raise SystemExit("brokendep cannot build")\n',
      'brokendep-1.0/PKG-INFO':
      b'Metadata-Version: 2.1\nName: brokendep\nVersion: 1.0\n',
  }
  with tarfile.open(sdist, 'w:gz') as tar:
    for name, data in files.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  contents = {
      sdist.name: sdist.read_bytes(),
      deps.EXTRA_PACKAGES_FILE: f'{sdist.name}\n'.encode()}
  root = tmp_path / 'root'
  with pytest.raises(PipelineExecutionError, match='brokendep cannot build'):
    deps.install(deps.dependency_set(contents), deps.fetch_from(contents), str(root))
  # Nothing that a retry would take for a finished install.
  assert [n for n in os.listdir(root) if not n.endswith('.lock')] == []


def test_other_environments_file_artifacts_outlive_beams_temp_dir(tmp_path):
  """A Java expansion service's jars, which Beam's ExternalTransform
  downloads into the pipeline's local_tempdir, are linked into the run's
  directory: Pipeline.run removes local_tempdir when run_pipeline returns,
  before this runner's job has read them."""
  beam_temp = tmp_path / 'beam-pipeline-temp'
  beam_temp.mkdir()
  jar = beam_temp / 'tmpabc'
  jar.write_bytes(b'PK jar bytes')
  pipeline = beam_runner_api_pb2.Pipeline()
  java = pipeline.components.environments['java']
  java.urn = common_urns.environments.PROCESS.urn
  for _ in range(2):  # the same file named twice is linked once
    java.dependencies.add(
        type_urn=common_urns.artifact_types.FILE.urn,
        type_payload=beam_runner_api_pb2.ArtifactFilePayload(
            path=str(jar)).SerializeToString())
  staged = StagedDependencies(PipelineOptions([]))
  adopted = staged.add_to(pipeline)
  paths = [
      beam_runner_api_pb2.ArtifactFilePayload.FromString(
          a.type_payload).path
      for a in adopted.components.environments['java'].dependencies
  ]
  assert paths[0] == paths[1]
  assert paths[0].startswith(staged.directory + os.sep)
  import shutil
  shutil.rmtree(beam_temp)  # what Pipeline.run does
  with open(paths[0], 'rb') as f:
    assert f.read() == b'PK jar bytes'
  # The caller's pipeline is unchanged.
  original = beam_runner_api_pb2.ArtifactFilePayload.FromString(
      pipeline.components.environments['java'].dependencies[0].type_payload)
  assert original.path == str(jar)

  class Execution:
    pass

  owner = Execution()
  staged.remove_after(owner)
  del owner
  gc.collect()
  assert not os.path.exists(paths[0])
