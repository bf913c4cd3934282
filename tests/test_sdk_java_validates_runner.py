"""Beam's Java @ValidatesRunner tests through Java's portable runner.

One job server (local[2], LOOPBACK: each test's Java harnesses run in the
surefire JVM, as Beam runs these tests against its portable runners);
Maven Surefire runs the chosen classes of beam-sdks-java-core's tests jar
against it (tests/java_validates_runner.py: which, and every exclusion with
its reason). The surefire reports are then read here: every test that ran
passed, and as many ran as expected (a class that silently ran fewer tests,
e.g. after a category changed, fails this too).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import time

import pytest

import java_validates_runner as vr
from java_sdk import SDK_DIR
from java_sdk import classpath
from jobserver_process import JobServerProcess

# Two test JVMs against the one job server: a test's time is mostly
# waiting (harnesses starting, Spark scheduling), so two overlap well.
FORKS = 2
# Surefire's whole run: 248 tests in 19 minutes on 2 cores at load 17-28
# (other work running), 820 s in CI; 495 s at load 5-9 since the release
# of LOOPBACK harnesses left the path to DONE (Java's client polls a job's
# state every 3 s, so most small jobs are now seen done at the first poll).
TIMEOUT_SECS = 2700


@pytest.mark.timeout(TIMEOUT_SECS + 300)  # past the project's 900 s
def test_java_validates_runner_suite(tmp_path):
  classpath()  # fails, saying to run `make sdk-java`, if it was not run
  assert shutil.which('mvn'), 'Maven (mvn) is needed: make sdk-java installs it'
  reports = tmp_path / 'reports'
  # Spark starts while Maven and the surefire JVMs do, not at the first job.
  server = JobServerProcess(tmp_path / 'artifacts', spark_warm_up=True)
  started = time.monotonic()
  try:
    with open(tmp_path / 'mvn.log', 'wb') as log:
      proc = subprocess.run(
          ['mvn', *vr.surefire_args(server.job_endpoint, FORKS),
           f'-Dvr.reports={reports}'],
          cwd=SDK_DIR, stdout=log, stderr=subprocess.STDOUT,
          timeout=TIMEOUT_SECS, check=False)
  except subprocess.TimeoutExpired:
    done = vr.read_reports(str(reports)) if reports.exists() else []
    pytest.fail(
        f'surefire did not finish in {TIMEOUT_SECS} s ({len(done)} tests '
        f'reported; a job stuck?)\n--- job server ---\n{server.log()[-6000:]}')
  finally:
    server_log = server.log()[-4000:]
    server.stop()
  seconds = time.monotonic() - started
  outcomes = vr.read_reports(str(reports))
  by_status = collections.defaultdict(list)
  for outcome in outcomes:
    by_status[outcome.status].append(outcome)
  failed = by_status['failed'] + by_status['error']
  summary = (
      f'{len(by_status["passed"])} passed, {len(failed)} failed, '
      f'{len(by_status["skipped"])} skipped in {seconds:.0f} s '
      f'({seconds / max(1, len(outcomes)):.1f} s a test)')
  print(f'Java ValidatesRunner: {summary}')
  # A failure is either a runner bug to fix or a test to exclude with its
  # reason in java_validates_runner.py: never silently accepted.
  assert not failed, summary + '\n' + '\n\n'.join(
      f'{o.test}: {o.message[:1500]}' for o in failed) + (
          '\n--- job server ---\n' + server_log)
  assert proc.returncode == 0, (tmp_path / 'mvn.log').read_text()[-6000:]
  counts = collections.Counter(o.test.split('#')[0] for o in by_status['passed'])
  assert dict(counts) == {s.cls: s.passes for s in vr.SELECTIONS}, summary
  # Skipped: only the tests Beam's own code skips (assumptions), listed.
  assert {o.test for o in by_status['skipped']} == set(vr.SKIPPED_BY_BEAM)
