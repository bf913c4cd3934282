"""The pipeline's Python dependencies, as Beam's PortableRunner stages them.

``--requirements_file``, ``--extra_package``, ``--setup_file``,
``--save_main_session``, ``--files_to_stage``: Beam's stager turns these into
artifacts of the SDK environment (``Stager.create_job_resources``, which
``environments.python_sdk_dependencies`` calls). ``PySparkRunner`` attaches
them to its embedded environment, so the engine ships them to executors
exactly as it ships what a job server received from a PortableRunner client.

Other environments' file artifacts (a Java expansion service's jars, which
Beam's ``ExternalTransform`` downloads into the pipeline's
``local_tempdir``) are linked into the run's directory too: ``Pipeline.run``
removes its ``local_tempdir`` as soon as ``run_pipeline`` returns, which for
this runner is before the job has started, where Beam's PortableRunner has
already staged them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

from apache_beam.options import pipeline_options
from apache_beam.portability import common_urns
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability import stager
from apache_beam.transforms import environments


class StagedDependencies:
  """The artifacts of one run, built in a temporary directory of its own."""
  def __init__(self, options: pipeline_options.PipelineOptions):
    self.directory = tempfile.mkdtemp(prefix='beam-pyspark-staging-')
    try:
      setup = options.view_as(pipeline_options.SetupOptions)
      self.artifacts = stager.Stager.create_job_resources(
          options,
          self.directory,
          pypi_requirements=[
              name + version for name, version in
              environments.PyPIArtifactRegistry.get_artifacts()
          ],
          skip_prestaged_dependencies=(
              setup.prebuild_sdk_container_engine is not None),
          # Beam's container only logs this `pip freeze`; it costs a second
          # per run.
          log_submission_env_dependencies=False)
    except BaseException:
      self.remove()
      raise
    if not self.artifacts:
      self.remove()

  def add_to(
      self, pipeline: beam_runner_api_pb2.Pipeline
  ) -> beam_runner_api_pb2.Pipeline:
    """The pipeline with the artifacts on its embedded Python environments
    (those that carry none of their own), and every environment's file
    artifacts in the run's directory."""
    if not self.artifacts and not _file_artifacts(pipeline):
      return pipeline
    pipeline = beam_runner_api_pb2.Pipeline.FromString(
        pipeline.SerializeToString())
    for env in pipeline.components.environments.values():
      if env.urn == python_urns.EMBEDDED_PYTHON and not env.dependencies:
        env.dependencies.extend(self.artifacts)
    self._adopt_files(pipeline)
    return pipeline

  def _adopt_files(self, pipeline: beam_runner_api_pb2.Pipeline) -> None:
    if not os.path.isdir(self.directory):
      self.directory = tempfile.mkdtemp(prefix='beam-pyspark-staging-')
    adopted: dict[str, str] = {}
    for artifact in _file_artifacts(pipeline):
      payload = beam_runner_api_pb2.ArtifactFilePayload.FromString(
          artifact.type_payload)
      source = payload.path
      if source.startswith(self.directory + os.sep):
        continue
      if source not in adopted:
        target = os.path.join(self.directory, f'file-{len(adopted)}')
        try:
          os.link(source, target)  # same file system: no copy
        except OSError:
          shutil.copyfile(source, target)
        adopted[source] = target
      payload.path = adopted[source]
      artifact.type_payload = payload.SerializeToString()

  def remove_after(self, owner: object) -> None:
    """Removes the files once owner (the job's execution) is gone, or at
    exit: the engine reads them when the job starts, on its own thread."""
    weakref.finalize(owner, shutil.rmtree, self.directory, True)

  def remove(self) -> None:
    shutil.rmtree(self.directory, ignore_errors=True)


def _file_artifacts(pipeline: beam_runner_api_pb2.Pipeline) -> list:
  file_urn = common_urns.artifact_types.FILE.urn
  return [
      artifact for env in pipeline.components.environments.values()
      for artifact in env.dependencies if artifact.type_urn == file_urn
  ]
