"""Getting a SparkContext: the user's active one, or one we start."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from typing import Optional

from beam_pyspark.errors import BeamPySparkError
from beam_pyspark.javahome import find_java
from beam_pyspark.spark.jvm import java_options

_LOGGER = logging.getLogger(__name__)

DEFAULT_MASTER = 'local[*]'

# Settings we choose unless the user sets them.
_DEFAULT_CONF = {
    'spark.ui.showConsoleProgress': 'false',
    'spark.python.worker.reuse': 'true',
    # Python workers forked with Beam already imported (spark/daemon.py).
    'spark.python.daemon.module': 'beam_pyspark.spark.daemon',
    # Every task's start and end reaches the status store (StatusTracker,
    # Spark's UI) as it happens. With Spark's 100 ms two tasks ending
    # together write only the first, and the store caught up at the next
    # executor heartbeat, up to 10 s later: a progress line or status page
    # showed a wave of tasks neither ending nor starting.
    'spark.ui.liveUpdate.period': '0ms',
}


def console_progress_bar(conf: Optional[dict] = None) -> bool:
  """Whether Spark's console progress bar is on: the running context's
  setting, else the one a context started with ``conf`` would get."""
  from pyspark import SparkContext
  active = SparkContext._active_spark_context
  if active is not None:
    value = active.getConf().get('spark.ui.showConsoleProgress', 'false')
  else:
    value = dict(_DEFAULT_CONF, **(conf or {}))['spark.ui.showConsoleProgress']
  return str(value).lower() == 'true'


def check_java() -> None:
  if find_java():
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
  from pyspark import SparkConf
  from pyspark import SparkContext

  # Read under the lock getOrCreate holds while it builds a context:
  # PySpark publishes a SparkContext as active before its JVM side exists,
  # and the job server's warm-up and its first job (a resumed one at once)
  # ask together (a job given it failed: "no attribute '_jsc'").
  with SparkContext._lock:
    active = SparkContext._active_spark_context
  if active is not None:
    if master and active.master != master:
      _LOGGER.warning(
          'A SparkContext for %s is already running; using it instead of %s.',
          active.master, master)
    missing = not_applied(active.getConf(), conf or {})
    if missing:
      _LOGGER.warning(
          'A SparkContext is already running: these Spark settings are not '
          'applied to it: %s. Stop it first to apply them.', missing)
    return active

  check_java()
  if master:
    check_master_reachable(master)
  # Executors must run the same interpreter (and so the same installed Beam)
  # as the driver.
  os.environ.setdefault('PYSPARK_PYTHON', sys.executable)
  os.environ.setdefault('PYSPARK_DRIVER_PYTHON', sys.executable)
  master = master or DEFAULT_MASTER
  settings = dict(_DEFAULT_CONF)
  if master.startswith('local'):
    # Local executors can import what the driver imports (user modules
    # pickled by reference need it).
    settings['spark.executorEnv.PYTHONPATH'] = driver_python_path()
  settings.update(conf or {})
  # Spark's classes from an archive made on this machine (spark/jvm.py).
  archive = java_options()
  if archive:
    settings['spark.driver.extraJavaOptions'] = ' '.join(
        filter(None, [settings.get('spark.driver.extraJavaOptions'), archive]))
  spark_conf = SparkConf().setMaster(master).setAppName('beam-pyspark')
  for key, value in settings.items():
    spark_conf.set(key, value)
  # A SparkContext, not a SparkSession: batch needs no SQL, and the session
  # cost 2 s more of every fresh process's start (3.2 s against 5.3 s
  # here). SparkSession.builder.getOrCreate() wraps this context later.
  sc = _create(SparkContext, spark_conf)
  sc.setLogLevel('WARN')
  _quiet_task_failures(sc)
  _LOGGER.info('Started Spark %s on %s', sc.version, master)
  return sc


def _create(spark_context_class, spark_conf):
  """``SparkContext.getOrCreate``, once more if Spark's UI lost a race.

  On YARN the ApplicationMaster, once registered, has the driver add its
  proxy filter to every UI handler while SparkContext's constructor may
  still be starting those handlers (SparkUI.attachAllHandlers, unlocked):
  Jetty then fails the constructor with a ConcurrentModificationException
  (a job server's first job on a loaded machine failed so, CI). The
  context that failed stopped itself, and its application with it; a
  second start does not meet the race again as a rule."""
  try:
    return spark_context_class.getOrCreate(spark_conf)
  except Exception as exn:  # pylint: disable=broad-except
    if not _ui_start_race(str(exn)):
      raise
    _LOGGER.warning(
        'Spark failed to start its UI (a race of its own with the YARN '
        'ApplicationMaster\'s UI filter: ConcurrentModificationException '
        'in SparkUI.attachAllHandlers); starting Spark once more')
    return spark_context_class.getOrCreate(spark_conf)


def _ui_start_race(error: str) -> bool:
  """Whether a SparkContext's constructor failed on Spark's UI race."""
  return ('java.util.ConcurrentModificationException' in error and
          'attachAllHandlers' in error)


def not_applied(running_conf, conf: dict) -> list[str]:
  """The keys of ``conf`` whose values a running context (its SparkConf)
  does not have. A job server's --spark-conf pairs reach every job's
  spark_context(); its first job (or its warm-up) started the context with
  them, and the jobs after it must not be told they were ignored."""
  missing = []
  for key, value in conf.items():
    running = running_conf.get(key)
    # spark_context() appends the class archive's flag to the driver's
    # extraJavaOptions (spark/jvm.py): the user's value is a part of it.
    if running == str(value) or (
        key == 'spark.driver.extraJavaOptions' and running
        and str(value) in running):
      continue
    missing.append(key)
  return sorted(missing)


_LOCAL = re.compile(r'^local(?:\[(?P<threads>\*|\d+)(?:,\d+)?\])?$')


def master_info(sc) -> dict:
  """The master the job runs on as given ('local[*]'), and for a local one
  the cores Spark resolved it to: '*' is the JVM's available processors
  (SparkContext's localCpuCount), which a container's CPU limit lowers."""
  info: dict = {'master': sc.master}
  local = _LOCAL.match(sc.master or '')
  if local:
    threads = local.group('threads')
    if threads == '*':
      try:
        info['cores'] = int(sc._jvm.java.lang.Runtime.getRuntime()  # pylint: disable=protected-access
                            .availableProcessors())
      except Exception:  # pylint: disable=broad-except
        pass  # the context stopped: the master alone
    else:
      info['cores'] = int(threads or 1)
  return info


# Spark logs every failed task attempt with the whole Python traceback
# (Executor, then TaskSetManager twice): a user's one failing element
# printed its message 36 times. The job's error carries the traceback once;
# these stay available with the beam_pyspark logger at DEBUG.
_TASK_FAILURE_LOGGERS = (
    'org.apache.spark.executor.Executor',
    'org.apache.spark.scheduler.TaskSetManager',
)


def _quiet_task_failures(sc) -> None:
  if logging.getLogger('beam_pyspark').isEnabledFor(logging.DEBUG):
    return
  try:
    jvm = sc._jvm  # pylint: disable=protected-access
    configurator = jvm.org.apache.logging.log4j.core.config.Configurator
    level = jvm.org.apache.logging.log4j.Level.OFF
    for name in _TASK_FAILURE_LOGGERS:
      configurator.setLevel(name, level)
  except Exception:  # pylint: disable=broad-except
    _LOGGER.debug('Could not quiet Spark\'s task failure logs', exc_info=True)


MASTER_CONNECT_SECS = 5.0


def check_master_reachable(master: str, timeout: float = MASTER_CONNECT_SECS,
                           connect=socket.create_connection) -> None:
  """Fails fast, naming the master, when no standalone master answers.

  Spark itself retries registering with an unreachable standalone master
  for about a minute and then stops the SparkContext; the job then failed
  with "Cannot call methods on a stopped SparkContext", the cause only in
  Spark's earlier logs. Other masters (local, yarn, k8s) are not probed.
  """
  if not master.startswith('spark://'):
    return
  errors = []
  for address in master[len('spark://'):].split(','):
    host, _, port = address.strip().rpartition(':')
    if not host or not port.isdigit():
      raise BeamPySparkError(
          f'Spark master URL {master!r} is malformed: use '
          'spark://HOST:PORT[,HOST:PORT...] (e.g. spark://master:7077).')
    try:
      connect((host.strip('[]'), int(port)), timeout).close()
      return
    except OSError as exn:
      errors.append(f'{address.strip()}: {exn.strerror or exn}')
  raise BeamPySparkError(
      f'Cannot reach the Spark master {master} ({"; ".join(errors)}). '
      'Check that the master is running and that this host can reach it '
      '(its host and port: --spark_master_url for PySparkRunner, '
      '--spark-master-url for the job server).')
