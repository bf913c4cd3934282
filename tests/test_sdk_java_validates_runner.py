"""Beam's Java @ValidatesRunner tests through Java's portable runner.

A job server (local[2], LOOPBACK: each test's Java harnesses run in the
surefire JVM, as Beam runs these tests against its portable runners) for
each of Maven Surefire's test JVMs, which run the chosen classes of
beam-sdks-java-core's tests jar against them (tests/java_validates_runner.py:
which, and every exclusion with its reason). The surefire reports are then read here: every test that ran
passed, and as many ran as expected (a class that silently ran fewer tests,
e.g. after a category changed, fails this too).
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import subprocess
import time

import pytest

from beam_pyspark.local.processes import free_port
import java_validates_runner as vr
from java_sdk import SDK_DIR
from java_sdk import classpath
from jobserver_process import JobServerProcess

# Two test JVMs: a test's time is mostly waiting (harnesses starting, Spark
# scheduling), so two overlap well. Each has a job server of its own, so
# that the tests of one never share a Spark (and its Python workers) with
# the other's: a job that fails (a test expecting a failure) ends the Python
# worker its task failed in, and with it the harnesses other running jobs
# kept there; Java's LOOPBACK pool cannot start another for its job once one
# of its harnesses ended (Beam's FnHarness shuts down the executor its
# pool's harnesses share), and that job failed, 'the SDK harness never
# connected' (CI, testHotKeyCombining beside ViewTest's
# testMapSideInputWithNullValuesCatchesDuplicates).
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
  # Fork N's server listens on 127.0.0.N, all on one port: Surefire puts
  # each fork's number in its options (${surefire.forkNumber}). Spark starts
  # while Maven and the surefire JVMs do, not at the first job.
  port = _port_free_on(FORKS)
  servers = []
  try:
    for n in range(1, FORKS + 1):
      servers.append(JobServerProcess(
          tmp_path / f'artifacts{n}', '--job-host', f'127.0.0.{n}',
          '--job-port', str(port), spark_warm_up=True))
  except BaseException:
    for server in servers:
      server.stop()
    raise
  endpoint = f'127.0.0.${{surefire.forkNumber}}:{port}'
  started = time.monotonic()
  try:
    with open(tmp_path / 'mvn.log', 'wb') as log:
      proc = subprocess.run(
          ['mvn', *vr.surefire_args(endpoint, FORKS),
           f'-Dvr.reports={reports}'],
          cwd=SDK_DIR, stdout=log, stderr=subprocess.STDOUT,
          timeout=TIMEOUT_SECS, check=False)
  except subprocess.TimeoutExpired:
    done = vr.read_reports(str(reports)) if reports.exists() else []
    pytest.fail(
        f'surefire did not finish in {TIMEOUT_SECS} s ({len(done)} tests '
        f'reported; a job stuck?)\n' + '\n'.join(
            f'--- job server {n} ---\n{server.log()[-4000:]}'
            for n, server in enumerate(servers, 1)))
  finally:
    server_log = '\n'.join(
        f'--- job server {n} ---\n{server.log()[-2500:]}'
        for n, server in enumerate(servers, 1))
    for server in servers:
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
      f'{o.test}: {o.message[:1500]}\n(its JVM\'s errors: {o.errors[-1500:]})'
      for o in failed) + '\n' + server_log
  assert proc.returncode == 0, (tmp_path / 'mvn.log').read_text()[-6000:]
  counts = collections.Counter(o.test.split('#')[0] for o in by_status['passed'])
  assert dict(counts) == {s.cls: s.passes for s in vr.SELECTIONS}, summary
  # Skipped: only the tests Beam's own code skips (assumptions), listed.
  assert {o.test for o in by_status['skipped']} == set(vr.SKIPPED_BY_BEAM)


def _port_free_on(hosts: int) -> int:
  """A port free on 127.0.0.1 to 127.0.0.``hosts`` (Linux's lo holds all
  of 127.0.0.0/8)."""
  for _ in range(50):
    port = free_port()  # on 127.0.0.1
    try:
      for n in range(2, hosts + 1):
        with socket.socket() as other:
          other.bind((f'127.0.0.{n}', port))
    except OSError:
      continue
    return port
  raise RuntimeError(f'no port free on 127.0.0.1-{hosts}')
