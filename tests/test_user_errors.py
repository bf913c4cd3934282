"""What a user sees when their pipeline fails, or Spark cannot start.

A DoFn's exception comes back as its own type (as Beam's DirectRunner
raises it), with the step's name and the traceback from the executor in its
text, once; an unreachable standalone master fails fast, naming the master
and the cause.
"""

import os
import subprocess
import sys

import apache_beam as beam
import pytest

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.errors import user_exception
from conftest import spark_options
from user_errors import InventoryError

TESTS = os.path.dirname(os.path.abspath(__file__))


def fail_on_three(x):
  if x == 3:
    raise ValueError(f'bad element {x}')
  return x


def short_of_stock(x):
  raise InventoryError(f'no stock for item {x}')


def test_user_exception_keeps_its_type_step_and_traceback():
  with pytest.raises(ValueError) as raised:
    with beam.Pipeline(options=spark_options()) as p:
      _ = p | beam.Create(range(6)) | 'CheckStock' >> beam.Map(fail_on_three)
  error = raised.value
  # Still what this runner raised before, for code that catches that.
  assert isinstance(error, PipelineExecutionError)
  text = str(error)
  assert text.startswith("bad element 3 [while running 'CheckStock']")
  assert 'fail_on_three' in text  # the user's frame, from the executor
  assert 'test_user_errors.py' in text


def test_users_own_exception_class_comes_back():
  with pytest.raises(InventoryError, match='no stock for item 1'):
    with beam.Pipeline(options=spark_options()) as p:
      _ = p | beam.Create([1]) | beam.Map(short_of_stock)


def test_error_text_without_a_traceback_or_importable_type_is_kept():
  assert user_exception('Cannot reach the Spark master') is None
  text = ('Traceback (most recent call last):\n  File "x.py", line 1\n'
          'no_such_module.NoSuchError: gone')
  assert user_exception(text) is None
  rebuilt = user_exception(
      'Traceback (most recent call last):\n  File "x.py", line 1\n'
      'KeyError: 7', details='the details')
  assert isinstance(rebuilt, KeyError)
  assert 'the details' in str(rebuilt)


_MASTER_SCRIPT = '''
import time
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
p = beam.Pipeline(options=PipelineOptions([
    '--runner=beam_pyspark.PySparkRunner',
    '--spark_master_url=spark://127.0.0.1:1']))
_ = p | beam.Create([1]) | beam.Map(str)
started = time.monotonic()
try:
  p.run().wait_until_finish()
except Exception as exn:  # what the user would see
  print('ELAPSED', time.monotonic() - started)
  print('ERROR', type(exn).__name__, exn)
'''


def test_unreachable_master_fails_fast_naming_master_and_cause():
  # Its own process: the tests' SparkContext would be reused otherwise.
  done = subprocess.run(
      [sys.executable, '-c', _MASTER_SCRIPT], capture_output=True, text=True,
      timeout=300, check=False)
  lines = done.stdout.splitlines()
  elapsed = float(next(l for l in lines if l.startswith('ELAPSED')).split()[1])
  error = done.stdout.split('\nERROR ', 1)[1]
  assert 'spark://127.0.0.1:1' in error
  assert 'Connection refused' in error
  assert elapsed < 15, elapsed


_SCRIPT = '''
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from test_user_errors import fail_on_three
with beam.Pipeline(options=PipelineOptions([
    '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]'])) as p:
  _ = p | beam.Create(range(6)) | 'CheckStock' >> beam.Map(fail_on_three)
'''


def test_a_failing_element_is_reported_once_not_by_every_log():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [TESTS] + sys.path))
  done = subprocess.run(
      [sys.executable, '-c', _SCRIPT], env=env, cwd=TESTS,
      capture_output=True, text=True, timeout=300, check=False)
  output = done.stdout + done.stderr
  assert done.returncode != 0
  assert output.rstrip().endswith(
      "ValueError: bad element 3 [while running 'CheckStock']"), output[-2000:]
  # Spark's own task-failure logs repeat the whole traceback per attempt.
  assert 'TaskSetManager' not in output
  assert 'Exception in task' not in output
  # The raised error's headline, its traceback's last two lines, and the
  # driver's one-line log: not the 36 copies of the message seen before.
  assert output.count('bad element 3') <= 6, output
