"""The pipeline's Python dependencies, as Beam's PortableRunner stages them.

``--requirements_file``, ``--extra_package``, ``--setup_file``,
``--save_main_session``, ``--files_to_stage``: Beam's stager turns these into
artifacts of the SDK environment (``Stager.create_job_resources``, which
``environments.python_sdk_dependencies`` calls). ``PySparkRunner`` attaches
them to its embedded environment, so the engine ships them to executors
exactly as it ships what a job server received from a PortableRunner client.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref

from apache_beam.options import pipeline_options
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
    (those that carry none of their own)."""
    if not self.artifacts:
      return pipeline
    pipeline = beam_runner_api_pb2.Pipeline.FromString(
        pipeline.SerializeToString())
    for env in pipeline.components.environments.values():
      if env.urn == python_urns.EMBEDDED_PYTHON and not env.dependencies:
        env.dependencies.extend(self.artifacts)
    return pipeline

  def remove_after(self, owner: object) -> None:
    """Removes the files once owner (the job's execution) is gone, or at
    exit: the engine reads them when the job starts, on its own thread."""
    weakref.finalize(owner, shutil.rmtree, self.directory, True)

  def remove(self) -> None:
    shutil.rmtree(self.directory, ignore_errors=True)
