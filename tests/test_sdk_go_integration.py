"""Beam's Go integration tests (sdks/go/test/integration) on the job server.

Run as Beam's sdks/go/test/run_validatesrunner_tests.sh runs them for a
portable runner: each package's compiled test binary (`make sdk-go`: `go
test -c` of the packages of Beam's Go SDK module, at the version pinned in
sdks/go/go.mod) with `-test.v --runner=portable --endpoint=<our job
server> --environment_type=LOOPBACK` (the script passes DOCKER and a Go
container, which an executor here cannot start; LOOPBACK runs the same
harness code in the test binary). The packages run at once, one job
server for all (it runs jobs concurrently), as `go test` runs packages in
parallel.

Every test calls Beam's integration.CheckFilters, which skips what Beam's
own filter list for portable runners (`portableFilters` in
sdks/go/test/integration/integration.go) names: TestStream, triggers and
panes, self-checkpointing, drain, map/set/ordered-list state, timers,
bundle finalization, GCP/Kafka/FHIR IOs, heap dumps. Skips must be those
and nothing else; every other test must pass.

Packages of the integration tree that are not run here (no wider exclusion
is made inside the packages that are run):
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time

import pytest

import go_sdk
from jobserver_process import JobServerProcess

# The packages of Beam's sdks/go/test/integration (and test/regression)
# that are not built or run here, and why. Each needs something outside
# the runner that this machine and CI do not have; none tests the runner
# beyond what the run packages do.
NOT_RUN = {
    'integration (the package itself)':
        'unit tests of the helpers that start expansion services from jars '
        '(expansions_test.go); no pipeline runs on a runner',
    'xlang, transforms/xlang/dataframe, transforms/xlang/inference':
        'cross-language: need --test_expansion_addr or a Python expansion '
        'service address (Beam\'s script starts Java\'s test expansion '
        'service from a jar Beam builds); without one each test skips '
        'itself. Cross-language runs on the job server are issue 25\'s '
        'Java part',
    'io/xlang/{kafka,jdbc,debezium,bigquery,bigtable}':
        'cross-language IOs: Java expansion services and Kafka, PostgreSQL '
        'or GCP services (testcontainers needs Docker, which is not here)',
    'io/bigqueryio, io/spannerio, io/fhirio':
        'Google Cloud services (also filtered by Beam for portable runners)',
    'io/mongodbio':
        'starts MongoDB in a Docker container (testcontainers); no Docker '
        'daemon on this machine or CI',
    'regression/coders/fromyaml':
        'a unit test of the coders of a YAML file; runs no pipeline',
}
__doc__ += ''.join(f'\n- {k}: {v}.' for k, v in NOT_RUN.items())

# Our exclusions beyond Beam's portableFilters: test name -> why. Empty:
# every test the run packages do not filter for portable runners passes.
EXCLUDED: dict[str, str] = {}

# What each package passes: a change (a new skip, a test that no longer
# runs) must be seen.
PASSES = {'primitives': 21, 'synthetic': 2, 'wordcount': 1, 'regression': 13}

# Beyond Beam's filters: tests of primitives that Beam filters for portable
# runners (its Python job service lacks the feature) and that this runner
# passes. Run with --runner=universal, Go's same portable runner under a
# name CheckFilters has no list for. What each exercises on a Go harness:
BEYOND_FILTERS = {
    'TestCheckpointing': 'a splittable DoFn that checkpoints itself',
    'TestParDoBundleFinalizer': 'bundle finalization callbacks',
    'TestOrderedListState': 'ordered list user state',
    'TestTimers_EventTime_Bounded': 'event-time timers',
    'TestTimers_EventTime_Unbounded': 'event-time timers, streaming',
    'TestTimers_EventTime_WithOutputTimestamp': 'timer output timestamps',
    'TestTimers_EventTime_WithNoOutputTimestamp': 'timer output timestamps',
    'TestTimers_ProcessingTime_Bounded': 'processing-time timers',
    'TestTimers_ProcessingTime_Unbounded': 'processing-time timers, streaming',
    'TestTimers_ProcessingTime_Infinity': 'processing-time timers, TestStream',
    'TestTestStreamInt64Sequence': 'TestStream',
    'TestTestStreamTwoInt64Sequences': 'TestStream, flattened',
    'TestTestStreamFloat64Sequence': 'TestStream',
    'TestTestStreamTwoFloat64Sequences': 'TestStream, flattened',
    'TestTestStreamBoolSequence': 'TestStream',
    'TestTestStreamTwoBoolSequences': 'TestStream, flattened',
    'TestTestStreamTwoUserTypeSequences': 'TestStream of a Go struct type',
    'TestTestStreamTimersEventTime': 'TestStream and event-time timers',
    'TestMapState': 'map user state (multimap_user_state and its keys)',
    'TestMapStateClear': 'map user state, cleared whole',
    'TestSetState': 'set user state (a map of keys to nothing)',
    'TestSetStateClear': 'set user state, cleared whole',
    'TestTestStreamSimple': 'TestStream of a Go-coded element (opaque bytes)',
    'TestTestStreamSimple_InfinityDefault':
        'TestStream of a Go-coded element, watermark to +inf by default',
    'TestTestStreamToGBK': 'TestStream of Go-coded elements into a GroupByKey',
    'TestTestStreamStrings': 'TestStream of strings (Go encodes nested)',
    'TestTestStreamByteSliceSequence': 'TestStream of byte slices (nested)',
    'TestTestStreamInt16Sequence': 'TestStream of int16s (Go-coded, nested)',
    'TestPanes': 'pane info of triggered firings',
    'TestTriggerDefault': 'default trigger, streaming',
    'TestTriggerElementCount': 'AfterCount trigger',
    'TestTriggerAfterEndOfWindow': 'AfterEndOfWindow with early firings',
    'TestTriggerAfterAll': 'AfterAll trigger',
    'TestTriggerAfterSynchronizedProcessingTime':
        'AfterSynchronizedProcessingTime trigger',
    'TestTriggerNever': 'Never trigger',
    # Prism's firings: the trigger runs after each element, so one
    # TestStream event of three elements under Always fires three panes
    # (planning.sdks.fires_per_element), and combines under Always or an
    # element count are not lifted (planning.lifting).
    'TestTriggerAlways': 'Always trigger, a pane per element',
    'TestTriggerRepeat': 'Repeat(AfterCount(2))',
    'TestTriggerAfterEach': 'AfterEach(AfterCount(3), Always), repeated',
    'TestTriggerAfterAny': 'AfterAny(AfterCount(3), Always), repeated',
    'TestTriggerOrFinally': 'OrFinally(Always, AfterCount(2))',
}
# Filtered by Beam for portable runners, and failing here too (not run;
# the lead's list of what a Go pipeline cannot do yet on this runner):
FAILING_BEYOND_FILTERS = {
    'TestTriggerAfterProcessingTime':
        'expects a pane of the element that arrives after a one-shot '
        'AfterProcessingTime fired (6, then 4 at the end of the global '
        'window), as Prism emits it. The trigger has finished by then, and '
        'Beam closes a window whose trigger finished: its Python '
        'DirectRunner and trigger driver (which this runner runs) drop the '
        '4, as Java\'s ReduceFnRunner drops elements of a closed window',
    'TestDrain': 'needs the runner to drain a streaming job by itself',
    'TestOomParDo': 'a heap dump on Dataflow only',
}
BEAMS_FILTER = 'is currently filtered for runner portable'
BEYOND_SHARDS = 2
TIMEOUT_SECS = 540


def _run(package: str, binary: str, endpoint: str, workdir: str,
         only: tuple[str, ...] = ()):
  log = os.path.join(workdir, f'{package}.log')
  args = [binary, '-test.v', f'-test.timeout={TIMEOUT_SECS - 30}s',
          *go_sdk.portable_args(endpoint, 'LOOPBACK')]
  if only:  # past Beam's filters: Go's portable runner by another name
    args[args.index('--runner=portable')] = '--runner=universal'
    args.append('-test.run=^(' + '|'.join(only) + ')$')
  if EXCLUDED:
    args.append('-test.skip=^(' + '|'.join(EXCLUDED) + ')$')
  start = time.monotonic()
  # TMPDIR: Go's runner leaves a file there per LOOPBACK job.
  with open(log, 'wb') as out:
    proc = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT,
                          cwd=workdir, timeout=TIMEOUT_SECS, check=False,
                          env={**os.environ, 'TMPDIR': workdir})
  return proc.returncode, log, time.monotonic() - start


@pytest.fixture(scope='module')
def results(tmp_path_factory):
  """Every package's run: (exit code, log path, seconds, listed tests)."""
  binaries = {p: go_sdk.program(b) for p, b in go_sdk.TEST_PACKAGES.items()}
  runs = {p: (b, ()) for p, b in binaries.items()}
  beyond = sorted(BEYOND_FILTERS)
  for shard in range(BEYOND_SHARDS):
    runs[f'beyond-{shard}'] = (binaries['primitives'],
                               tuple(beyond[shard::BEYOND_SHARDS]))
  server = JobServerProcess(tmp_path_factory.mktemp('go-it') / 'artifacts')
  try:
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
      futures = {
          p: pool.submit(_run, p, b, server.job_endpoint,
                         str(tmp_path_factory.mktemp(f'go-{p}')), only)
          for p, (b, only) in runs.items()
      }
      out = {}
      for package, future in futures.items():
        rc, log, secs = future.result()
        binary, only = runs[package]
        listed = list(only) or go_sdk.list_tests(binary)
        out[package] = (rc, log, secs, listed)
  finally:
    server.stop()
  return out


@pytest.mark.parametrize('package', sorted(go_sdk.TEST_PACKAGES))
def test_beams_go_integration_package(results, package):
  rc, log, secs, listed = results[package]
  text = go_sdk.read_output(log)
  tests = go_sdk.parse_verbose(text)
  top = {name: t for name, t in tests.items() if '/' not in name}
  excluded = [n for n in listed if n in EXCLUDED]
  # Every test the binary has ran to an end, but those we exclude.
  assert sorted(top) == sorted(set(listed) - set(excluded)), (
      f'{package}: tests that did not run or did not end: '
      f'{sorted(set(listed) - set(top) - set(excluded))} '
      f'{[n for n, t in top.items() if t.status == "RUN"]}\n{text[-5000:]}')
  failed = {n: t.text[-3000:] for n, t in tests.items() if t.status == 'FAIL'}
  assert not failed, f'{package}: failed (log {log}):\n' + '\n'.join(
      f'--- {n}\n{o}' for n, o in failed.items())
  # A skip is Beam's filter for portable runners, nothing else.
  skipped = {n: t for n, t in tests.items() if t.status == 'SKIP'}
  unargued = {n: t.text[-500:] for n, t in skipped.items()
              if BEAMS_FILTER not in t.text}
  assert not unargued, f'{package}: skipped, not by Beam\'s filter: {unargued}'
  passed = sorted(n for n, t in top.items() if t.status == 'PASS')
  assert len(passed) == PASSES[package], (package, passed)
  assert rc == 0, f'{package}: exit code {rc}\n{text[-3000:]}'
  print(f'{package}: {len(passed)} passed, {len(skipped)} skipped by Beam\'s '
        f'portable filters, {len(excluded)} excluded, in {secs:.0f} s')


def test_beyond_beams_filters(results):
  """The tests Beam filters for portable runners that this runner passes."""
  passed, failed = [], {}
  for shard in range(BEYOND_SHARDS):
    rc, log, secs, listed = results[f'beyond-{shard}']
    tests = go_sdk.parse_verbose(go_sdk.read_output(log))
    missing = set(listed) - set(tests)
    assert not missing, f'did not run: {sorted(missing)} (log {log})'
    passed += [n for n in listed if tests[n].status == 'PASS']
    failed.update({n: tests[n].text[-3000:] for n in listed
                   if tests[n].status != 'PASS'})
    print(f'beyond Beam\'s filters, shard {shard}: {len(listed)} in {secs:.0f} s')
  assert not failed, '\n'.join(f'--- {n}\n{o}' for n, o in failed.items())
  assert sorted(passed) == sorted(BEYOND_FILTERS)
