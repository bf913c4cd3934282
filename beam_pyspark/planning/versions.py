"""Which Beam version an environment's SDK is, and whether ours can run it.

A Python client pickles its functions with its own Beam (2.61's with dill,
a module our Beam no longer needs; a class moved between versions fails to
unpickle the same way), so the embedded harness, which is the job server's
Beam, runs only a client of the same minor version. Users of a job server
rarely share its version: the version is read from what the client sends,

- its Docker image's tag (``apache/beam_python3.11_sdk:2.61.0``), and
- its ``beam:version:sdk_base:<image>`` capability, which Beam's SDKs list
  whatever environment type the job uses,

and a Python image of another version is not mapped to the embedded harness
(``planning.environments``): it runs in a harness of its own version where
the job or the server opted in (``=versioned``: ``boot.python`` installs
that apache-beam into a cached virtualenv on the executor), or is refused at
Prepare, naming both versions and what works.

Java, Go and TypeScript harnesses are not ours: their boots run the client's
own SDK (Java's from the jars the client stages), so any version of theirs
runs.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

import apache_beam
from apache_beam.portability.api import beam_runner_api_pb2

SDK_BASE = 'beam:version:sdk_base:'
# apache/beam_python3.11_sdk:2.61.0, docker.io/apache/beam_java17_sdk:2.70.0,
# apache/beam_go_sdk:2.62.0rc1, with a digest or not.
_BEAM_IMAGE = re.compile(
    r'(?:^|/)beam_(?P<sdk>[a-z]+)(?P<lang>[0-9.]*)_sdk:'
    r'(?P<version>\d+\.\d+[0-9A-Za-z.+-]*)')
_MINOR = re.compile(r'^(\d+)\.(\d+)')
OURS = apache_beam.__version__
OUR_PYTHON = f'{sys.version_info.major}.{sys.version_info.minor}'


def image_version(image: str) -> Optional[str]:
  """The Beam version in the tag of one of Beam's SDK images, else None."""
  m = _BEAM_IMAGE.search(image)
  return m.group('version') if m else None


def image_python(image: str) -> Optional[str]:
  """The Python version of one of Beam's Python images (``3.11``)."""
  m = _BEAM_IMAGE.search(image)
  return m.group('lang') or None if m and m.group('sdk') == 'python' else None


def environment_version(env: beam_runner_api_pb2.Environment
                        ) -> Optional[str]:
  """The client's Beam version: its Docker image's tag, else the version
  in its sdk_base capability; None when neither names one (a custom image
  of a custom tag, an environment of a non-Beam SDK)."""
  if env.urn == 'beam:env:docker:v1':
    found = image_version(beam_runner_api_pb2.DockerPayload.FromString(
        env.payload).container_image)
    if found:
      return found
  for capability in env.capabilities:
    if capability.startswith(SDK_BASE):
      found = image_version(capability[len(SDK_BASE):])
      if found:
        return found
  return None


def same_minor(a: str, b: str = OURS) -> bool:
  """Whether two Beam versions share major.minor (patch releases keep the
  pickled forms); an unparsable one is taken as the same."""
  ma, mb = _MINOR.match(a), _MINOR.match(b)
  return not (ma and mb) or ma.groups() == mb.groups()
