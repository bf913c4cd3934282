"""Beam's Java @ValidatesRunner tests against the job server: what runs.

Not a test module (tests/test_sdk_java_validates_runner.py runs it). The
tests are Beam's own, in the ``tests`` jar of ``beam-sdks-java-core``, run
by Maven Surefire through Java's portable runner (``TestUniversalRunner``:
Beam's ``PortableRunner`` against an already running job service, as Beam
runs them against its Python "universal local runner",
runners/portability/java/build.gradle), LOOPBACK, in batch.

Which tests: Beam's whole ValidatesRunner set is ~420 tests at ~5-15 s each
on this runner (every test is a job: staging the 60-jar classpath, planning,
Spark stages, Java harnesses over LOOPBACK), more than the CI budget of the
Java part (~12 minutes on 2 cores). So whole test classes that cover the
areas the runner must get right are chosen (CLASSES, with why), and in them
Beam's own exclusions for its portable Spark and Flink job servers apply
(EXCLUDED_CATEGORIES, from runners/spark/job-server/spark_job_server.gradle
and runners/flink/job-server/flink_job_server.gradle), plus the tests named
in EXCLUDED_TESTS, each with its reason.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import xml.etree.ElementTree as ET

T = 'org.apache.beam.sdk.transforms.'
C = 'org.apache.beam.sdk.testing.'

# Test classes run, and what each covers.
CLASSES = {
}

# JUnit categories never run, and why. Each is one of Beam's own exclusions
# for its portable Spark (batch) or Flink job servers unless it says so.
EXCLUDED_CATEGORIES = {
}

# Single tests (Class#method) not run, and why.
EXCLUDED_TESTS = {
}


def surefire_args(job_endpoint: str, forks: int = 1) -> list[str]:
  """The arguments of ``mvn -o surefire:test`` in sdks/java."""
  tests = ','.join(list(CLASSES) + [f'!{t}' for t in EXCLUDED_TESTS])
  options = [
      '--runner=TestUniversalRunner', f'--jobEndpoint={job_endpoint}',
      '--defaultEnvironmentType=LOOPBACK', '--experiments=beam_fn_api']
  return [
      '-B', '-o', 'surefire:test', f'-Dtest={tests}',
      f'-Dgroups={C}ValidatesRunner',
      f'-DexcludedGroups={",".join(EXCLUDED_CATEGORIES)}',
      f'-DforkCount={forks}', '-DreuseForks=true',
      '-DbeamTestPipelineOptions=[' + ','.join(
          f'"{o}"' for o in options) + ']']


@dataclasses.dataclass
class Outcome:
  test: str  # Class#method
  status: str  # passed, failed, error, skipped
  seconds: float
  message: str = ''


def read_reports(directory: str) -> list[Outcome]:
  """Every test case in surefire's XML reports."""
  out = []
  for path in sorted(glob.glob(os.path.join(directory, 'TEST-*.xml'))):
    for case in ET.parse(path).getroot().iter('testcase'):
      status, message = 'passed', ''
      for kind in ('failure', 'error', 'skipped'):
        node = case.find(kind)
        if node is not None:
          status = 'failed' if kind == 'failure' else kind
          message = ((node.get('message') or '') + '\n' +
                     (node.text or ''))[:4000]
          break
      out.append(Outcome(
          f'{case.get("classname")}#{case.get("name")}', status,
          float(case.get('time') or 0), message))
  return out
