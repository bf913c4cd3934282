"""What each staged job holds, on disk, so a restarted server knows.

The blob store counts references in memory only. A server that restarts
would otherwise not know which staged files its retained jobs still use: it
could neither keep them safely nor delete them when those jobs' history
entries are dropped later, and files of jobs it no longer knows (or of
uploads cut short by a crash) would stay forever.

One small JSON file per staged job, named by the digest of its staging token
(a token contains the client's job name, so it is never a file name itself):

  {"version": 1, "staging_token": ..., "files": [stored file names],
   "resolved": {environment: [base64 of ArtifactInformation]}}

It is written (atomically: temporary file, then rename) once a job's files
are all committed, before the job counts as staged, and removed with the job.
A crash between committing files and writing the manifest leaves files that
no manifest names: start-up deletes them.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import uuid
from typing import Mapping
from typing import Sequence

from apache_beam.portability.api import beam_runner_api_pb2

from beam_pyspark.artifacts.store import remove_quietly

_LOGGER = logging.getLogger(__name__)

VERSION = 1
_SUFFIX = '.json'
_TEMP_PREFIX = '.tmp-'

ArtifactInformation = beam_runner_api_pb2.ArtifactInformation


@dataclasses.dataclass
class Manifest:
  staging_token: str
  files: list[str]
  resolved: dict[str, list[ArtifactInformation]]


class ManifestStore:
  def __init__(self, directory: str):
    os.makedirs(directory, exist_ok=True)
    self.directory = os.path.realpath(directory)

  def _path(self, staging_token: str) -> str:
    digest = hashlib.sha256(staging_token.encode('utf-8')).hexdigest()
    return os.path.join(self.directory, digest + _SUFFIX)

  def write(
      self, staging_token: str, files: Sequence[str],
      resolved: Mapping[str, Sequence[ArtifactInformation]]) -> None:
    document = {
        'version': VERSION,
        'staging_token': staging_token,
        'files': sorted(set(files)),
        'resolved': {
            env: [
                base64.b64encode(a.SerializeToString()).decode('ascii')
                for a in artifacts
            ]
            for env, artifacts in resolved.items()
        },
    }
    temp = os.path.join(self.directory, f'{_TEMP_PREFIX}{uuid.uuid4().hex}')
    try:
      with open(temp, 'x', encoding='utf-8') as f:
        json.dump(document, f)
        f.flush()
        os.fsync(f.fileno())
      os.replace(temp, self._path(staging_token))
    except BaseException:
      remove_quietly(temp)
      raise

  def remove(self, staging_token: str) -> None:
    remove_quietly(self._path(staging_token))

  def load_all(self) -> list[Manifest]:
    """Every readable manifest; unreadable ones are logged and removed.

    Leftover temporary files (a crash mid-write) are removed too.
    """
    manifests = []
    for name in sorted(os.listdir(self.directory)):
      path = os.path.join(self.directory, name)
      if name.startswith(_TEMP_PREFIX):
        remove_quietly(path)
        continue
      if not name.endswith(_SUFFIX):
        continue
      try:
        with open(path, encoding='utf-8') as f:
          document = json.load(f)
        if document.get('version') != VERSION:
          raise ValueError(f'unknown version {document.get("version")!r}')
        manifest = Manifest(
            staging_token=document['staging_token'],
            files=list(document['files']),
            resolved={
                env: [
                    ArtifactInformation.FromString(base64.b64decode(a))
                    for a in artifacts
                ]
                for env, artifacts in document['resolved'].items()
            })
      except Exception as exn:  # pylint: disable=broad-except
        # Its files then count as unreferenced: losing a record costs a
        # re-stage at worst, keeping garbage forever costs disk.
        _LOGGER.warning(
            'Ignoring unreadable staging manifest %s: %s: %s', path,
            type(exn).__name__, exn)
        remove_quietly(path)
        continue
      if self._path(manifest.staging_token) != path:
        _LOGGER.warning(
            'Ignoring staging manifest %s: it names another token', path)
        remove_quietly(path)
        continue
      manifests.append(manifest)
    return manifests
