"""Getting a SparkContext: the user's active one, or one we start."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from typing import Optional

from beam_pyspark.errors import BeamPySparkError

_LOGGER = logging.getLogger(__name__)

DEFAULT_MASTER = 'local[*]'

# Settings we choose unless the user sets them.
_DEFAULT_CONF = {
    'spark.ui.showConsoleProgress': 'false',
    'spark.python.worker.reuse': 'true',
}


def check_java() -> None:
  java_home = os.environ.get('JAVA_HOME')
  if java_home and os.path.exists(os.path.join(java_home, 'bin', 'java')):
    return
  if shutil.which('java'):
    return
  raise BeamPySparkError(
      'Spark needs Java (17 or later), but no `java` is on PATH and JAVA_HOME '
      'is not set. Install a JDK (e.g. `apt-get install openjdk-17-jre-headless`) '
      'or set JAVA_HOME, then run again.')


def driver_python_path() -> str:
  return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


def spark_context(master: Optional[str] = None, conf: Optional[dict] = None):
  """The active SparkContext if there is one, else a new one.

  A user who already has Spark running keeps it: the pipeline runs there.
  """
  from pyspark import SparkContext
  from pyspark.sql import SparkSession

  active = SparkContext._active_spark_context
  if active is not None:
    if master and active.master != master:
      _LOGGER.warning(
          'A SparkContext for %s is already running; using it instead of %s.',
          active.master, master)
    if conf:
      _LOGGER.warning(
          'A SparkContext is already running: these Spark settings are not '
          'applied to it: %s. Stop it first to apply them.', sorted(conf))
    return active

  check_java()
  # Executors must run the same interpreter (and so the same installed Beam)
  # as the driver.
  os.environ.setdefault('PYSPARK_PYTHON', sys.executable)
  os.environ.setdefault('PYSPARK_DRIVER_PYTHON', sys.executable)
  master = master or DEFAULT_MASTER
  builder = SparkSession.builder.master(master).appName('beam-pyspark')
  settings = dict(_DEFAULT_CONF)
  if master.startswith('local'):
    # Local executors can import what the driver imports (user modules
    # pickled by reference need it).
    settings['spark.executorEnv.PYTHONPATH'] = driver_python_path()
  settings.update(conf or {})
  for key, value in settings.items():
    builder = builder.config(key, value)
  session = builder.getOrCreate()
  session.sparkContext.setLogLevel('WARN')
  _LOGGER.info('Started Spark %s on %s', session.version, master)
  return session.sparkContext
