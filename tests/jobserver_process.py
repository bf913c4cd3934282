"""A real ``beam-pyspark job-server`` in a subprocess, for tests.

Not a test module: the staging-memory, expansion and restart tests share it.
The server's log goes to a file next to its artifacts, so a failing test can
show why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import grpc
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2_grpc
from apache_beam.portability.api import beam_job_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

_LISTENING = re.compile(r'(Job|Artifact|Expansion) service listening on (.*)$')


class JobServerProcess:
  """Starts the CLI with free ports; ``stop()`` ends it (SIGTERM)."""
  def __init__(
      self, artifacts_dir, *extra_args: str, timeout: float = 120,
      env: dict | None = None, spark_warm_up: bool = False):
    self.artifacts_dir = str(artifacts_dir)
    os.makedirs(self.artifacts_dir, exist_ok=True)
    self.log_path = os.path.join(
        os.path.dirname(self.artifacts_dir.rstrip(os.sep)),
        os.path.basename(self.artifacts_dir.rstrip(os.sep)) + '.log')
    self._log = open(self.log_path, 'ab')
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'beam_pyspark.cli', 'job-server',
         '--job-port', '0', '--artifact-port', '0', '--expansion-port', '0',
         '--status-port', '0',
         '--artifacts-dir', self.artifacts_dir, '--spark-master-url',
         'local[2]',
         # The server's default starts Spark at start: most tests' servers
         # run a job or two, or none, and a JVM started for none costs CI
         # time; the tests that run a job server's jobs right after its start
         # keep the default (spark_warm_up=True).
         *([] if spark_warm_up else ['--no-spark-warm-up']), *extra_args],
        stdout=subprocess.PIPE, stderr=self._log, text=True,
        env=None if env is None else {**os.environ, **env})
    self.pid = self.proc.pid
    self.endpoints: dict[str, str] = {}
    self.status_url = None
    deadline = time.monotonic() + timeout
    try:
      while len(self.endpoints) < 3 and time.monotonic() < deadline:
        line = self.proc.stdout.readline()
        if not line:
          raise RuntimeError(
              f'job server exited ({self.proc.wait()}) before listening; '
              f'log:\n{self.log()}')
        status = re.match(r'Status page at (\S+)$', line.strip())
        if status:
          self.status_url = status.group(1)
        m = _LISTENING.match(line.strip())
        if m:
          self.endpoints[m.group(1).lower()] = m.group(2)
      if len(self.endpoints) < 3:
        raise RuntimeError(f'job server did not start; log:\n{self.log()}')
    except BaseException:
      self.stop()
      raise
    self.job_endpoint = self.endpoints['job']
    self.artifact_endpoint = self.endpoints['artifact']
    self.expansion_endpoint = self.endpoints['expansion']
    self.channel = grpc.insecure_channel(self.job_endpoint)
    self.job_stub = beam_job_api_pb2_grpc.JobServiceStub(self.channel)
    self.artifact_channel = grpc.insecure_channel(self.artifact_endpoint)
    self.staging_stub = beam_artifact_api_pb2_grpc.ArtifactStagingServiceStub(
        self.artifact_channel)
    self.retrieval_stub = (
        beam_artifact_api_pb2_grpc.ArtifactRetrievalServiceStub(
            self.artifact_channel))

  def log(self) -> str:
    self._log.flush()
    with open(self.log_path, 'rb') as f:
      return f.read().decode('utf-8', 'replace')[-20000:]

  def stop(self) -> None:
    for name in ('channel', 'artifact_channel'):
      channel = getattr(self, name, None)
      if channel is not None:
        channel.close()
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(30)
    self.proc.stdout.close()
    self._log.close()


def file_dependency(path: str, staged_name: str):
  """A FILE artifact as Beam's stager makes them."""
  return beam_runner_api_pb2.ArtifactInformation(
      type_urn=common_urns.artifact_types.FILE.urn,
      type_payload=beam_runner_api_pb2.ArtifactFilePayload(
          path=path).SerializeToString(),
      role_urn=common_urns.artifact_roles.STAGING_TO.urn,
      role_payload=beam_runner_api_pb2.ArtifactStagingToRolePayload(
          staged_name=staged_name).SerializeToString())


def url_dependency(url: str, sha256: str = ''):
  return beam_runner_api_pb2.ArtifactInformation(
      type_urn=common_urns.artifact_types.URL.urn,
      type_payload=beam_runner_api_pb2.ArtifactUrlPayload(
          url=url, sha256=sha256).SerializeToString())


def pipeline_with_dependencies(artifacts):
  """A small runnable pipeline whose one environment depends on artifacts."""
  import apache_beam as beam
  from apache_beam.transforms import environments
  p = beam.Pipeline()
  _ = p | beam.Create([1, 2]) | beam.Map(lambda x: x + 1)
  return p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment(
          capabilities=environments.python_sdk_capabilities(),
          artifacts=list(artifacts)))
