"""Spark started by several threads at once: the job server's warm-up and
its first job (a resumed streaming job at once) both ask for the one
SparkContext. Before spark_context() serialized them, the second got the
context PySpark had published as active before its JVM side existed, and
the job failed with "'SparkContext' object has no attribute '_jsc'" (seen
in the test suite under load)."""

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent('''
    import threading
    import time
    from beam_pyspark.spark.session import spark_context

    got, errors = [], []

    def ask(delay):
      # One asks first; the others at moments while it starts Spark.
      time.sleep(delay)
      try:
        sc = spark_context('local[2]')
        got.append((id(sc), sc.defaultParallelism))
      except Exception as exn:  # what a job would have failed with
        errors.append(repr(exn))

    threads = [threading.Thread(target=ask, args=(0.3 * i,))
               for i in range(16)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    print('ERRORS', errors)
    print('GOT', len(got), len({g[0] for g in got}), sorted({g[1] for g in got}))
''')


def test_threads_starting_spark_together_all_get_the_one_working_context():
  done = subprocess.run([sys.executable, '-c', _SCRIPT], capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  assert 'ERRORS []' in done.stdout, done.stdout + done.stderr[-4000:]
  # Sixteen answers, one context, its parallelism read through its JVM.
  assert 'GOT 16 1 [2]' in done.stdout, done.stdout


_SETTINGS_SCRIPT = textwrap.dedent('''
    import logging
    import sys
    from beam_pyspark.spark.session import spark_context

    logging.basicConfig(stream=sys.stdout, level=logging.WARNING,
                        format='%(levelname)s %(message)s')
    conf = {'spark.beam.test.one': 'a', 'spark.beam.test.two': 'b'}
    spark_context('local[1]', conf)
    print('SAME')
    spark_context('local[1]', dict(conf))  # a job server's next job
    print('OTHER')
    spark_context('local[1]', {**conf, 'spark.beam.test.two': 'c',
                                'spark.beam.test.three': 'd'})
''')


def test_a_running_context_is_said_to_ignore_only_settings_it_lacks():
  """The job server hands its --spark-conf pairs to every job; the context
  its first job started has them. Every later job logged "A SparkContext
  is already running: these Spark settings are not applied to it: [all of
  them]"; only settings of other values, or none, are not applied."""
  done = subprocess.run([sys.executable, '-c', _SETTINGS_SCRIPT],
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  out = done.stdout
  same = out[out.index('SAME'):out.index('OTHER')]
  other = out[out.index('OTHER'):]
  assert 'not applied' not in same, out
  assert ("not applied to it: ['spark.beam.test.three', "
          "'spark.beam.test.two']") in other, out


# The error a job server's first job on YARN failed with (CI, a loaded
# machine): PySpark's Py4JJavaError, its Java trace in its text.
_UI_RACE = '''An error occurred while calling None.org.apache.spark.api.java.JavaSparkContext.
: java.util.ConcurrentModificationException
	at java.base/java.util.ArrayList$ArrayListSpliterator.forEachRemaining(ArrayList.java:1631)
	at org.sparkproject.jetty.ee10.servlet.ServletHandler.initialize(ServletHandler.java:687)
	at org.apache.spark.ui.ServerInfo.addHandler(JettyUtils.scala:575)
	at org.apache.spark.ui.SparkUI.$anonfun$attachAllHandlers$2(SparkUI.scala:84)
	at org.apache.spark.SparkContext.<init>(SparkContext.scala:703)'''


class _Contexts:
  """SparkContext's getOrCreate, failing with the given errors first."""
  def __init__(self, *errors):
    self.errors = list(errors)
    self.calls = 0

  def getOrCreate(self, conf):  # pylint: disable=invalid-name
    self.calls += 1
    if self.errors:
      raise RuntimeError(self.errors.pop(0))
    return ('context', conf)


def test_spark_is_started_once_more_after_its_ui_lost_its_race_with_yarn():
  from beam_pyspark.spark import session
  contexts = _Contexts(_UI_RACE)
  assert session._create(contexts, 'conf') == ('context', 'conf')  # pylint: disable=protected-access
  assert contexts.calls == 2
  # Only once: a second failure is the job's.
  contexts = _Contexts(_UI_RACE, _UI_RACE)
  with pytest.raises(RuntimeError, match='attachAllHandlers'):
    session._create(contexts, 'conf')  # pylint: disable=protected-access
  assert contexts.calls == 2
  # Any other failure of the constructor is not retried.
  contexts = _Contexts('java.net.BindException: Cannot assign requested '
                       'address: Service sparkDriver failed after 16 retries')
  with pytest.raises(RuntimeError, match='sparkDriver'):
    session._create(contexts, 'conf')  # pylint: disable=protected-access
  assert contexts.calls == 1


_LATE_JOB_SCRIPT = textwrap.dedent('''
    import threading
    import time
    from beam_pyspark.spark.progress import cancel_group
    from beam_pyspark.spark.session import spark_context

    sc = spark_context('local[2]')
    sc.parallelize([0], 1).count()  # Spark warm: the late job starts at once
    cancel_group(sc, 'late')  # nothing of the group runs yet
    outcome = []

    def late():
      # An action that checked its job's cancel flag just before the
      # cancel: its Spark job starts a moment after.
      time.sleep(1.0)
      sc.setJobGroup('late', 'started after its cancel', True)
      started = time.monotonic()
      try:
        sc.parallelize([0], 1).foreach(lambda _: __import__('time').sleep(120))
        outcome.append(('RAN', time.monotonic() - started))
      except Exception as exn:
        outcome.append(('CANCELLED', time.monotonic() - started))

    thread = threading.Thread(target=late)
    thread.start()
    thread.join(200)
    print('OUTCOME', outcome[0][0], round(outcome[0][1]))
''')


def test_a_spark_job_that_starts_just_after_its_cancel_is_cancelled_too():
  """A job server's SIGTERM right after a job started found no Spark job to
  cancel (cancelJobGroup cancels the active ones only: "Cannot find active
  jobs for it"); the action then submitted its Spark job, which ran on, and
  the job ended FAILED, "did not stop within 10 s of its cancel" (CI).
  cancel_group cancels the group's jobs that start in the next 30 s."""
  done = subprocess.run([sys.executable, '-c', _LATE_JOB_SCRIPT],
                        capture_output=True, text=True, timeout=400,
                        check=False)
  assert done.returncode == 0, done.stderr[-4000:]
  outcome = done.stdout.split('OUTCOME ')[-1].split()
  assert outcome[0] == 'CANCELLED', done.stdout + done.stderr[-3000:]
  assert int(outcome[1]) < 60, outcome  # far from its 120 s
