"""Beam's portable-runner conformance suite on the Connect engine.

``PySparkPortableRunnerTest`` (tests/test_conformance.py: Beam's
``PortableRunnerTest`` through our job server, embedded harness) with the
job server started with ``--spark-remote`` against a Spark Connect server
the class starts (tests/connect_server.py, Spark's own Connect plugin over
local[2]). The job server is the Connect client, and runs as one with
only ``pyspark-client`` would: no working JVM (JAVA_HOME and PATH lead to
no java) and PySpark in its Connect-only mode.
"""
import os
import sys
import tempfile
import unittest

from connect_server import ConnectServer
from connect_server import client_environment
import test_conformance


def _streaming(reason: str):
  def skipped(self):
    raise unittest.SkipTest(reason)
  return skipped


_NO_STREAMING = (
    'a TestStream pipeline runs on the streaming engine, which the Connect '
    'engine refuses at submission (docs/spark-connect.md); its refusal is '
    'tested in tests/test_connect.py')


class PySparkConnectConformanceTest(test_conformance.PySparkPortableRunnerTest):
  @classmethod
  def setUpClass(cls):
    cls._server_dir = tempfile.mkdtemp(prefix='beam-pyspark-connect-')
    cls._server = ConnectServer(cls._server_dir)
    try:
      super().setUpClass()
    except BaseException:
      cls._server.stop()
      raise

  @classmethod
  def tearDownClass(cls):
    try:
      super().tearDownClass()
    finally:
      cls._server.stop()

  @classmethod
  def _subprocess_command(cls, job_port, expansion_port):
    command = super()._subprocess_command(job_port, expansion_port)
    env = client_environment()
    return (['/usr/bin/env'] +
            [f'{k}={env[k]}' for k in
             ('JAVA_HOME', 'PATH', 'SPARK_SKIP_CONNECT_COMPAT_TESTS')] +
            command + ['--spark-remote', cls._server.url])

  test_teststream_pardo_timers = _streaming(_NO_STREAMING)
  test_teststream_pardo_timers_output = _streaming(_NO_STREAMING)


del test_conformance
