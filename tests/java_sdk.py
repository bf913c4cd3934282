"""Beam's Java SDK for tests: the classpath `make sdk-java` resolved.

Not a test module: tests/test_sdk_java*.py share it. ``sdks/java/pom.xml``
pins Beam's Java SDK; `make sdk-java` (which `make test` runs) resolves it
into ~/.m2 and writes the classpath to sdks/java/target/classpath.txt;
``sdks/java-old/pom.xml`` an older Beam's client (`make sdk-java-old`).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from beam_pyspark.javahome import find_java

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SDK_DIR = os.path.join(ROOT, 'sdks', 'java')
CLASSPATH_FILE = os.path.join(SDK_DIR, 'target', 'classpath.txt')
# An older Beam's Java client, for the version-skew tests.
OLD_CLASSPATH_FILE = os.path.join(ROOT, 'sdks', 'java-old', 'target',
                                  'classpath.txt')
_MAKE_TARGETS = {CLASSPATH_FILE: 'sdk-java', OLD_CLASSPATH_FILE: 'sdk-java-old'}


def classpath(path: str = CLASSPATH_FILE) -> str:
  """The pipeline classpath, or the test fails saying how to get it (a
  missing SDK is a broken setup, never a reason to skip)."""
  if not os.path.exists(path):
    pytest.fail(
        f'{path} is missing: run `make {_MAKE_TARGETS[path]}` (make test '
        'does) to resolve Beam\'s Java SDK with Maven.')
  with open(path, encoding='utf-8') as f:
    return f.read().strip()


def beam_version(java_classpath: str) -> str:
  """The Beam version of a classpath: its beam-sdks-java-core jar's."""
  for jar in java_classpath.split(os.pathsep):
    m = re.match(r'beam-sdks-java-core-(\d+\.\d+\.\d+)\.jar$',
                 os.path.basename(jar))
    if m:
      return m.group(1)
  raise AssertionError(f'no beam-sdks-java-core jar in {java_classpath}')


def java() -> str:
  found = find_java()
  assert found, 'no java on PATH'
  return found


def run_java(main_class: str, args: list[str], log_path: str,
             timeout: float = 600, env: dict | None = None,
             java_classpath: str | None = None
             ) -> subprocess.CompletedProcess:
  """Runs ``main_class`` on the SDK's classpath (or ``java_classpath``);
  fails the test with the end of its log when it exits non-zero."""
  with open(log_path, 'wb') as log:
    proc = subprocess.run(
        [java(), '-cp', java_classpath or classpath(), main_class, *args],
        stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env,
        check=False)
  if proc.returncode != 0:
    with open(log_path, 'rb') as f:
      text = f.read().decode('utf-8', 'replace')
    pytest.fail(f'{main_class} exited with {proc.returncode}:\n'
                f'{text[-8000:]}')
  return proc


_STAGED = re.compile(
    r"Staged artifacts for '(?P<token>[^']*)': (?P<artifacts>\d+) artifacts, "
    r'(?P<fetched>\d+) fetched \((?P<bytes>\d+) bytes\), (?P<reused>\d+) '
    r'already stored, in (?P<secs>[\d.]+) s')


def staging_records(server_log: str) -> list[dict]:
  """What the job server's log says each job's staging fetched and reused,
  oldest first (beam_pyspark.artifacts.stream logs one line per job)."""
  return [{k: v if k == 'token' else float(v) if k == 'secs' else int(v)
           for k, v in m.groupdict().items()}
          for m in _STAGED.finditer(server_log)]
