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
Java part (~12 minutes on 2 cores). So test classes, or slices of the
large ones, that cover the areas the runner must get right are chosen
(SELECTIONS, with why). In them, the JUnit categories Beam's own suites
for its portable Spark and Flink job servers exclude
(runners/spark/job-server/spark_job_server.gradle,
runners/flink/job-server/flink_job_server.gradle) are excluded too, except
those tried here and found passing (EXCLUDED_CATEGORIES), and the tests
in EXCLUDED_TESTS; each with its reason.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import xml.etree.ElementTree as ET

T = 'org.apache.beam.sdk.transforms.'
C = 'org.apache.beam.sdk.testing.'


@dataclasses.dataclass(frozen=True)
class Selection:
  """Tests of one class: all of them, or the methods named."""
  cls: str
  passes: int  # how many pass (after the exclusions below)
  covers: str
  methods: tuple[str, ...] = ()

  def pattern(self) -> str:
    return self.cls + ('#' + '+'.join(self.methods) if self.methods else '')


# What runs. Whole classes where they are small; where a class is large
# (30-40 tests of one feature at ~15 s each), a slice of it that covers the
# feature's kinds (its other tests vary the same pipeline). Diagnostic runs
# of the whole classes passed as noted.
SELECTIONS = [
    Selection(T + 'ParDoTest$BasicTests', 5,
              'ParDo: outputs, empty inputs, options'),
    Selection(T + 'ParDoTest$MultipleInputsAndOutputTests', 4,
              'side inputs (whole class: 13 of 13 passed; ViewTest, every '
              'kind of view: 39 of 40, the 40th excluded below)',
              ('testParDoWithSideInputs', 'testSideInputAnnotation',
               'testSideInputsWithMultipleWindows',
               'testMultiOutputParDoWithSideInputs')),
    Selection(T + 'GroupByKeyTest$WindowTests', 4,
              'GroupByKey in fixed, sliding and merging (session) windows'),
    Selection(T + 'CombineTest$BasicTests', 6,
              'Combine per key and globally, hot-key fanout, empty inputs '
              '(whole class: 11 of 12 passed, the 12th is excluded below; '
              'the rest are lambda/method-reference variants)',
              ('testSimpleCombine', 'testSimpleCombineEmpty', 'testBasicCombine',
               'testHotKeyCombining', 'testCombinePerKeyLambda',
               'testCombinePerKeyPrimitiveDisplayData')),
    Selection(T + 'FlattenTest', 3,
              'Flatten (whole class: 15 of 15 passed)',
              ('testFlattenPCollections', 'testEmptyFlattenAsSideInput',
               'testFlattenInputMultipleCopies')),
    Selection(T + 'windowing.WindowTest', 4,
              'Window.into: timestamp combiners, no reassignment'),
    Selection(T + 'ParDoTest$StateTests', 4,
              'state: value, bag, combining, in fixed windows',
              ('testValueStateSimple', 'testBagState', 'testCombiningState',
               'testValueStateFixedWindows')),
    Selection(T + 'ParDoTest$TimerTests', 3,
              'event-time timers, per key, after a GroupByKey',
              ('testEventTimeTimerBounded', 'testEventTimeTimerMultipleKeys',
               'testGbkFollowedByUserTimers',
               'testTimerReceivedInOriginalWindow')),
    Selection(T + 'ParDoTest$TimerFamilyTests', 3,
              'timer families, event time, with plain timers (bounded; '
              'Beam\'s portable Spark excludes them)'),
    Selection(T + 'ParDoTest$KeyTests', 4,
              'the key in @OnTimer (Beam\'s portable Spark excludes it)'),
    Selection(T + 'SplittableDoFnTest', 7,
              'splittable DoFns, bounded: checkpoints, windowed side '
              'inputs, additional outputs'),
    Selection('org.apache.beam.sdk.metrics.MetricsTest$AttemptedMetricTests',
              6, 'counters, distributions, gauges, string sets, also in a '
              'source\'s split (Beam\'s portable Spark and Flink exclude '
              'gauges, its ULR string sets)'),
]

# JUnit categories never run, and why. Each is one of Beam's own exclusions
# for its portable Spark (batch) or Flink job servers unless it says so.
EXCLUDED_CATEGORIES = {
    C + 'UsesSdkHarnessEnvironment':
        'checks the SDK container\'s environment (Beam runs these only in '
        'its Docker suite); under LOOPBACK the harness is the test JVM',
    C + 'FlattenWithHeterogeneousCoders':
        'Flatten of inputs with different coders: Beam\'s portable runners '
        'do not re-encode them either',
    C + 'LargeKeys$Above100MB':
        '100 MB keys: more memory than the tests\' Spark and JVMs have',
    C + 'UsesCommittedMetrics':
        'Java\'s PortableRunner gives attempted metrics only: its results\' '
        'getCommitted() throws "This runner does not currently support '
        'committed metrics results" (tried: all 5 fail so, client-side)',
    C + 'UsesCustomWindowMerging':
        'merging by a WindowFn the runner does not know: refused at Prepare '
        '(only known merging WindowFns are merged)',
    C + 'UsesFailureMessage':
        'asserts the text of a failing DoFn\'s exception in the client, '
        'which Java\'s PortableRunner wraps in its own',
    C + 'UsesPerKeyOrderedDelivery':
        'delivery in arrival order per key: a Spark shuffle does not keep it',
    C + 'UsesPerKeyOrderInBundle': 'as UsesPerKeyOrderedDelivery',
    C + 'UsesParDoLifecycle':
        'teardown after exceptions in the same JVM (LOOPBACK): Beam '
        'excludes these for its portable runners (issue 20372)',
    C + 'UsesMapState': 'map state: Beam\'s portable batch runners exclude it',
    C + 'UsesSetState': 'set state: as map state',
    C + 'UsesMultimapState': 'multimap state: as map state',
    C + 'UsesOrderedListState': 'ordered list state: as map state',
    C + 'UsesLoopingTimer': 'timers that reset themselves forever, in batch',
    C + 'UsesUnboundedPCollections':
        'these tests run in batch (as Beam\'s portable Spark batch suite)',
    C + 'UsesUnboundedSplittableParDo': 'unbounded: batch suite',
    C + 'UsesTestStream': 'TestStream is a streaming source: batch suite',
    C + 'UsesOnWindowExpiration':
        'refused at Prepare: "pipeline requirement beam:requirement:pardo:'
        'on_window_expiration:v1 is not supported" (tried); all of Beam\'s '
        'portable runners (ULR, Spark, Flink) exclude it too',
    C + 'UsesStrictTimerOrdering':
        'timer firing order across keys and bundles: Beam\'s portable '
        'Spark and Flink exclude it',
    C + 'UsesBundleFinalizer': 'Beam\'s portable Spark batch excludes it',
    C + 'UsesTriggeredSideInputs':
        'Beam\'s ULR excludes it too. Here ViewTest#testTriggeredLatestSingleton '
        'failed after 10 minutes (IndexError decoding Java\'s '
        'AfterProcessingTime with no delay, apache_beam trigger.py:424); '
        'since eb8f2ec decodes it, the job hangs instead (reported)',
    C + 'UsesPythonExpansionService': 'cross-language: no expansion here',
    C + 'UsesJavaExpansionService': 'cross-language: no expansion here',
}

# Single tests (Class#method) not run, and why.
EXCLUDED_TESTS = {
    T + 'CombineTest$BasicTests#testHotKeyCombiningWithAccumulationMode':
        'fails on Beam\'s own Python job service too (Beam issue 20374, '
        'excluded for it in runners/portability/java/build.gradle): the '
        'final accumulated pane arrives empty',
    T + 'ParDoTest$TimerTests#testGbkFollowedByUserTimers':
        'RUNNER BUG (reported): failed with KeyError '
        '\'beam:coders:javasdk:0.1\' (a runner-side stage between the '
        'GroupByKey and the stateful DoFn ran in the embedded Python '
        'harness); since that stage runs in Java\'s environment (eca3895) '
        'the job hangs: the harness waits for the end of an input the '
        'runner never closes, the task for the harness\'s output',
}

# Tests Beam's own code skips (a JUnit assumption), expected as skipped.
SKIPPED_BY_BEAM = {
}


def surefire_args(job_endpoint: str, forks: int = 1) -> list[str]:
  """The arguments of ``mvn -o surefire:test`` in sdks/java."""
  tests = ','.join([s.pattern() for s in SELECTIONS] +
                   [f'!{t}' for t in EXCLUDED_TESTS])
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
