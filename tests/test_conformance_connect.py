"""Beam's portable-runner conformance suite on the Connect engine.

``PySparkPortableRunnerTest`` (tests/test_conformance.py: Beam's
``PortableRunnerTest`` through our job server, embedded harness) with the
job server started with ``--spark-remote`` against a Spark Connect server
(tests/connect_server.py, Spark's own Connect plugin over local[2]). The
job server is the Connect client, and runs as one with only
``pyspark-client`` would: no working JVM (JAVA_HOME and PATH lead to no
java), no py4j or pyspark.core to import (tests/connect_client), and the
class asserts it started no JVM.

The whole class runs in CI: 79 tests, 306 s of one worker at load 10-23
and 410 s at load 30-40 (the Connect server already started; 636 s
before the engine stopped asking the server for a schema per stage and
persisting side inputs). The
suite's streaming pipelines (a TestStream, PeriodicImpulse, an
unbounded source) are refused at submission over Connect: those tests
assert the refusal.
"""
import os

import connect_server
from connect_server import CLIENT_DIR
from connect_server import client_environment
from connect_server import started_programs
import test_conformance

REFUSAL = 'do not run over Spark Connect'


def _refused(test):
  """A streaming pipeline of the suite: refused at submission, saying so."""
  def refused(self):
    with self.assertRaisesRegex(Exception, REFUSAL):
      test(self)
  refused.__name__ = test.__name__
  return refused


class PySparkConnectConformanceTest(test_conformance.PySparkPortableRunnerTest):
  @classmethod
  def setUpClass(cls):
    cls._server = connect_server.shared()
    super().setUpClass()
    cls._audit = os.path.join(cls._workdir, 'client-processes.txt')

  @classmethod
  def tearDownClass(cls):
    # The job server, the Connect client, never started a JVM.
    started_programs(cls._audit)
    super().tearDownClass()

  @classmethod
  def _subprocess_command(cls, job_port, expansion_port):
    command = super()._subprocess_command(job_port, expansion_port)
    env = client_environment(os.path.join(cls._workdir, 'client-processes.txt'))
    return (['/usr/bin/env', '-u', 'SPARK_HOME'] +
            [f'{k}={env[k]}' for k in
             ('JAVA_HOME', 'PATH', 'PYTHONPATH', 'BEAM_PYSPARK_CLIENT_AUDIT')] +
            command + ['--spark-remote', cls._server.url])

  def test_job_server_is_a_connect_only_client(self):
    """The job server runs as a client with only pyspark-client would:
    no java to find, no py4j or pyspark.core to import, and it started
    no JVM (nor does it run one)."""
    import psutil
    self._get_job_endpoint()  # (started by the class's first job)
    job_server = psutil.Process(self._subprocess.pid)
    env = job_server.environ()
    assert env['JAVA_HOME'] == '/nonexistent-java'
    assert not any(os.path.exists(os.path.join(p, 'java'))
                   for p in env['PATH'].split(os.pathsep) if p)
    assert env['PYTHONPATH'].split(os.pathsep)[0] == CLIENT_DIR
    assert not [p for p in job_server.children(recursive=True)
                if 'java' in p.name()]
    started_programs(self._audit)

  # Streaming pipelines: a TestStream, PeriodicImpulse, an unbounded read.
  test_pardo_et_timer_with_no_firing = _refused(
      test_conformance.PySparkPortableRunnerTest
      .test_pardo_et_timer_with_no_firing)
  test_pardo_et_timer_with_no_reset = _refused(
      test_conformance.PySparkPortableRunnerTest
      .test_pardo_et_timer_with_no_reset)
  test_pardo_et_timer_with_no_reset_and_no_clear = _refused(
      test_conformance.PySparkPortableRunnerTest
      .test_pardo_et_timer_with_no_reset_and_no_clear)
  test_sliding_windows = _refused(
      test_conformance.PySparkPortableRunnerTest.test_sliding_windows)
  test_unbounded_source_read = _refused(
      test_conformance.PySparkPortableRunnerTest.test_unbounded_source_read)
  test_teststream_pardo_timers = _refused(
      test_conformance.PySparkPortableRunnerTest.test_teststream_pardo_timers)
  test_teststream_pardo_timers_output = _refused(
      test_conformance.PySparkPortableRunnerTest
      .test_teststream_pardo_timers_output)


del test_conformance
