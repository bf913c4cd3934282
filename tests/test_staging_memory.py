"""Staging a 200 MB artifact keeps the job server's memory bounded.

A real job server in a subprocess; Beam's own client code
(``offer_artifacts`` with its client-side retrieval service, as Beam's
PortableRunner stages) drives the reverse retrieval protocol after a real
Prepare. The server's resident memory is sampled with psutil while the
artifact streams in.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import psutil

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_artifact_api_pb2
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability import artifact_service as beam_artifacts

from jobserver_process import JobServerProcess
from jobserver_process import file_dependency
from jobserver_process import pipeline_with_dependencies

MB = 1 << 20
SIZE = 200 * MB
MAX_GROWTH = 150 * MB
MAX_RETAINED = 64 * MB


def _write_random_file(path, size) -> str:
  """size pseudo-random bytes (incompressible), hashed as they are written."""
  hasher = hashlib.sha256()
  block = os.urandom(MB)
  with open(path, 'wb') as f:
    for i in range(size // MB):
      # Every MB differs, so no layer can deduplicate its way to a pass.
      data = i.to_bytes(8, 'little') + block[8:]
      hasher.update(data)
      f.write(data)
  return hasher.hexdigest()


class RssSampler:
  """Samples a process's RSS every few milliseconds on a thread."""
  def __init__(self, pid: int, interval: float = 0.005):
    self._process = psutil.Process(pid)
    self._interval = interval
    self._stop = threading.Event()
    self.samples: list[int] = []
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.samples.append(self._process.memory_info().rss)
      self._stop.wait(self._interval)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def test_staging_200mb_keeps_server_memory_bounded(tmp_path):
  src = tmp_path / 'client'
  src.mkdir()
  path = str(src / 'big-dependency.tar.gz')
  digest = _write_random_file(path, SIZE)
  # Default settings: what a user gets.
  server = JobServerProcess(tmp_path / 'server')
  try:
    prepared = server.job_stub.Prepare(
        beam_job_api_pb2.PrepareJobRequest(
            job_name='big',
            pipeline=pipeline_with_dependencies(
                [file_dependency(path, 'big-dependency.tar.gz')])))
    assert prepared.artifact_staging_endpoint.url == server.artifact_endpoint
    server_process = psutil.Process(server.pid)
    baseline = server_process.memory_info().rss
    client = beam_artifacts.ArtifactRetrievalService(
        beam_artifacts.BeamFilesystemHandler(None).file_reader)

    with RssSampler(server.pid) as sampler:
      beam_artifacts.offer_artifacts(
          server.staging_stub, client, prepared.staging_session_token)
    # Let writers and gRPC free what they held: under load (CI, other
    # suites) that takes longer than on a quiet machine, so wait for the
    # memory to come back, up to 15 s, instead of one fixed pause.
    deadline = time.monotonic() + 15
    while True:
      time.sleep(0.5)
      after = server_process.memory_info().rss - baseline
      if after < MAX_RETAINED or time.monotonic() > deadline:
        break

    growth = max(sampler.samples) - baseline
    print(
        f'server RSS: baseline {baseline / MB:.1f} MB, peak '
        f'{max(sampler.samples) / MB:.1f} MB, growth {growth / MB:.1f} MB '
        f'over {len(sampler.samples)} samples, {after / MB:.1f} MB after')
    # The sampler really watched the staging, not an idle moment.
    assert len(sampler.samples) > 10
    assert growth < MAX_GROWTH, (
        f'staging {SIZE // MB} MB grew the job server by {growth / MB:.1f} MB')
    # And it gives the memory back: freed chunks do not stay in malloc's
    # arenas (see beam_pyspark/artifacts/memory.py).
    assert after < MAX_RETAINED, (
        f'after staging, the job server kept {after / MB:.1f} MB')

    # Intact: stored under its content address, and served byte-identical.
    staged_dir = tmp_path / 'server' / 'staged'
    [stored] = [n for n in os.listdir(staged_dir) if n.startswith(digest)]
    assert stored == f'{digest}-big-dependency.tar.gz'
    hasher, size = hashlib.sha256(), 0
    for chunk in server.retrieval_stub.GetArtifact(
        beam_artifact_api_pb2.GetArtifactRequest(
            artifact=beam_runner_api_pb2.ArtifactInformation(
                type_urn=common_urns.artifact_types.FILE.urn,
                type_payload=beam_runner_api_pb2.ArtifactFilePayload(
                    path=str(staged_dir / stored)).SerializeToString()))):
      hasher.update(chunk.data)
      size += len(chunk.data)
    assert (size, hasher.hexdigest()) == (SIZE, digest)
  finally:
    server.stop()
    os.remove(path)
    for name in os.listdir(tmp_path / 'server' / 'staged'):
      os.remove(tmp_path / 'server' / 'staged' / name)
