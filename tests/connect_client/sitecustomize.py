"""Makes an interpreter a Spark Connect-only client, as one with only
``pyspark-client`` installed (``beam-pyspark[connect]`` without the
classic pyspark) and no JVM.

Not a test module. On the PYTHONPATH of the tests' client processes only
(tests/connect_server.client_environment: the Connect jobs' client, the
conformance suite's job server), never of the Connect server or its
Python workers. Python imports it at start:

* ``py4j`` and ``pyspark.core`` cannot be imported, as with
  ``pyspark-client`` (which ships neither: no SparkContext, no RDDs, no
  gateway to a JVM); PySpark then finds itself Connect-only
  (``pyspark.util.is_remote_only()``) as it would there;
* every process this interpreter starts (``subprocess``, ``os.exec*``,
  ``os.posix_spawn``, ``os.system``) is appended to the file named by
  ``BEAM_PYSPARK_CLIENT_AUDIT``, and one of Java or of Spark's launch
  scripts is refused: the tests read the file and assert no JVM was
  ever started.
"""

import importlib.abc
import os
import sys

_BLOCKED = ('py4j', 'pyspark.core')
_JVM_LAUNCHERS = ('java', 'spark-submit', 'spark-class', 'pyspark')


class _ConnectOnly(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if any(name == b or name.startswith(b + '.') for b in _BLOCKED):
      raise ModuleNotFoundError(
          f'No module named {name!r} (a Spark Connect-only client: '
          'tests/connect_client)', name=name)
    return None


sys.meta_path.insert(0, _ConnectOnly())

_AUDIT = os.environ.get('BEAM_PYSPARK_CLIENT_AUDIT')
_EVENTS = ('subprocess.Popen', 'os.exec', 'os.posix_spawn', 'os.spawn',
           'os.system', 'os.fork')


def _program(event, args) -> str:
  if event == 'os.system':
    return str(args[0])
  if event == 'os.fork':
    return '(fork)'
  executable, argv = args[0], args[1] if len(args) > 1 else None
  if isinstance(argv, (list, tuple)) and argv:
    return ' '.join(os.fsdecode(a) if isinstance(a, bytes) else str(a)
                    for a in argv)
  return os.fsdecode(executable) if isinstance(executable, bytes) else str(
      executable)


def _audit(event, args):
  if event not in _EVENTS:
    return
  program = _program(event, args)
  with open(_AUDIT, 'a', encoding='utf-8') as f:
    f.write(f'{os.getpid()} {event} {program}\n')
  first = program.split()[0] if program.split() else ''
  if os.path.basename(first) in _JVM_LAUNCHERS:
    raise RuntimeError(f'a Connect-only client started {program!r}')


if _AUDIT:
  sys.addaudithook(_audit)
