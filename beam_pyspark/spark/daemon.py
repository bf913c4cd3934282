"""PySpark's Python worker daemon, with Beam imported before it forks.

Spark starts one daemon per executor (``spark.python.daemon.module``) and
forks every Python worker from it. Each worker used to import Beam itself:
about 1 s of CPU per new worker, on the first task of every job's new
workers. Importing it once here, before the first fork, gives every worker
Beam already loaded (copy-on-write), and its heap already frozen for
PySpark's per-task ``gc.collect()`` (spark.tasks._freeze_imported_heap).
A preload that fails costs nothing but the time: each worker imports what
it needs itself, and reports a real import error in its task.
"""

import gc
import os
import signal


def _preload() -> None:
  # Nothing here starts a gRPC thread; forking with gRPC's fork handlers
  # on has broken children before (cli.py), so they are off here too.
  os.environ.setdefault('GRPC_ENABLE_FORK_SUPPORT', 'false')
  # The modules a task of this runner imports (spark.tasks imports the
  # worker package, which imports Beam's harness).
  import beam_pyspark.spark.tasks  # pylint: disable=import-outside-toplevel,unused-import
  gc.freeze()


class _NoCtrlC:
  """``signal`` as pyspark.daemon sees it: SIGINT stays ignored.

  A terminal's Ctrl-C reaches every process of its group, Spark's Python
  workers too, and PySpark's daemon gives each worker it forks Python's
  KeyboardInterrupt for it (``pyspark.daemon.worker``): tasks died mid-way
  (a KeyboardInterrupt traceback, the JVM's "Broken pipe") while the driver
  was stopping the job between micro-batches. The driver stops them; they
  ignore Ctrl-C, as PySpark's JVM (started with SIGINT ignored) does."""
  def __getattr__(self, name):
    return getattr(signal, name)

  @staticmethod
  def signal(signalnum, handler):
    if signalnum == signal.SIGINT:
      handler = signal.SIG_IGN
    return signal.signal(signalnum, handler)


if __name__ == '__main__':
  try:
    _preload()
  except Exception:  # pylint: disable=broad-except
    pass
  import pyspark.daemon  # pylint: disable=import-outside-toplevel
  pyspark.daemon.signal = _NoCtrlC()
  pyspark.daemon.manager()
