"""Spark started by several threads at once: the job server's warm-up and
its first job (a resumed streaming job at once) both ask for the one
SparkContext. Before spark_context() serialized them, the second got the
context PySpark had published as active before its JVM side existed, and
the job failed with "'SparkContext' object has no attribute '_jsc'" (seen
in the test suite under load)."""

import subprocess
import sys
import textwrap

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
