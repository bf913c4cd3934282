"""SDK harnesses in their own processes, over the gRPC Fn API.

PROCESS starts Beam's own ``sdk_worker_main`` per Python worker; LOOPBACK
runs the harness in this (client) process. Both go through the same runner
side: control, data, state, logging and provisioning served by the executor.
"""

import logging
import os
import sys

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that
from apache_beam.testing.util import equal_to
from apache_beam.transforms import userstate

from beam_pyspark.errors import PipelineExecutionError

PROCESS = [
    '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
    '--environment_type=PROCESS',
    '--environment_config={"command": "%s -m '
    'apache_beam.runners.worker.sdk_worker_main"}' % sys.executable,
]


class BufferUntilTimer(beam.DoFn):
  """Per key: sums values in state, emits (key, sum) on the timer."""
  SUM = userstate.CombiningValueStateSpec('sum', sum)
  FLUSH = userstate.TimerSpec('flush', userstate.TimeDomain.WATERMARK)

  def process(
      self, kv, total=beam.DoFn.StateParam(SUM),
      flush=beam.DoFn.TimerParam(FLUSH)):
    total.add(kv[1])
    flush.set(100)

  @userstate.on_timer(FLUSH)
  def on_flush(
      self, key=beam.DoFn.KeyParam, total=beam.DoFn.StateParam(SUM)):
    yield key, total.read()


def _add_side(kv, offset):
  return kv[0], kv[1] + offset


def test_process_environment_with_state_timers_and_side_inputs():
  data = [('a', 1), ('b', 2), ('a', 3), ('c', 4), ('b', 5), ('a', 6)]
  with beam.Pipeline(options=PipelineOptions(PROCESS)) as p:
    side = p | 'side' >> beam.Create([10])
    keyed = (
        p | beam.Create(data)
        | beam.Map(lambda kv: beam.window.TimestampedValue(kv, 1)))
    summed = keyed | beam.ParDo(BufferUntilTimer())
    result = summed | beam.Map(_add_side, offset=beam.pvalue.AsSingleton(side))
    assert_that(result, equal_to([('a', 20), ('b', 17), ('c', 14)]))


def test_killed_harness_fails_the_job_clearly():
  def die_on_two(x):
    if x == 2:
      import os
      import signal
      os.kill(os.getpid(), signal.SIGKILL)  # the harness process itself
    return x

  p = beam.Pipeline(options=PipelineOptions(PROCESS))
  _ = p | beam.Create([1, 2, 3]) | beam.Map(die_on_two)
  with pytest.raises(PipelineExecutionError) as info:
    p.run().wait_until_finish()
  message = str(info.value)
  assert 'SDK harness process' in message, message
  assert 'killed by signal 9 (SIGKILL)' in message, message
  assert 'sdk_worker_main' in message, message


def test_harness_logs_reach_the_job_with_severity(client_log):
  def chatty(x):
    logging.getLogger('my.harness.dofn').warning('from the harness: %s', x)
    return x

  with beam.Pipeline(options=PipelineOptions(PROCESS)) as p:
    _ = p | beam.Create(['h1', 'h2']) | beam.Map(chatty)
  warnings = [
      text for level, text in client_log.seen if level == logging.WARNING]
  for x in ('h1', 'h2'):
    assert any(f'from the harness: {x}' in t for t in warnings), client_log.seen


def test_loopback_runs_the_dofns_in_the_client_process():
  import os
  client_pid = os.getpid()
  options = PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
      '--environment_type=LOOPBACK'])
  with beam.Pipeline(options=options) as p:
    pids = (
        p | beam.Create([1, 2, 3])
        | beam.Map(lambda _: __import__('os').getpid())
        | beam.Distinct())
    assert_that(pids, equal_to([client_pid]))


def test_process_environment_without_command_is_refused():
  from beam_pyspark.errors import UnsupportedPipelineError
  options = PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
      '--environment_type=PROCESS', '--environment_config={"command": " "}'])
  p = beam.Pipeline(options=options)
  _ = p | beam.Create([1]) | beam.Map(lambda x: x)
  with pytest.raises(UnsupportedPipelineError) as info:
    p.run()
  assert 'PROCESS without a command' in str(info.value)


class _SlowRange(beam.DoFn):
  """Emits 0..n-1 from one element, slowly: a straggling splittable bundle."""

  class Provider(beam.transforms.core.RestrictionProvider):
    def initial_restriction(self, n):
      from apache_beam.io.restriction_trackers import OffsetRange
      return OffsetRange(0, n)

    def create_tracker(self, restriction):
      from apache_beam.io.restriction_trackers import OffsetRestrictionTracker
      return OffsetRestrictionTracker(restriction)

    def restriction_size(self, element, restriction):
      return restriction.size()

    def split(self, element, restriction):
      yield restriction  # no initial splitting: only the runner splits it

  def process(
      self, n, tracker=beam.DoFn.RestrictionParam(Provider())):
    import time as t
    position = tracker.current_restriction().start
    while tracker.try_claim(position):
      t.sleep(0.02)
      yield position
      position += 1


def test_straggling_sdf_bundle_is_split_by_the_runner(client_log):
  n = 300  # about 6 s of work in one bundle
  with beam.Pipeline(options=PipelineOptions(
      PROCESS + ['--split_stragglers_after_secs=1'])) as p:
    out = p | beam.Create([n]) | beam.ParDo(_SlowRange())
    # Exactly once: nothing lost, nothing emitted twice.
    assert_that(out, equal_to(list(range(n))))
  texts = [t for _, t in client_log.seen]
  assert any('Split straggling bundle' in t for t in texts), texts
  assert any('split off straggling bundles run in another round' in t
             for t in texts), texts


def _parent_listening_addresses(_):
  """In the PROCESS harness: the addresses its parent (the Spark Python
  worker serving its Fn API) listens on, read from /proc like `ss -ltnp`."""
  import os
  import socket
  parent = os.getppid()
  inodes = set()
  for fd in os.listdir(f'/proc/{parent}/fd'):
    try:
      target = os.readlink(f'/proc/{parent}/fd/{fd}')
    except OSError:
      continue
    if target.startswith('socket:['):
      inodes.add(target[8:-1])
  found = []
  for table, family in (('tcp', socket.AF_INET), ('tcp6', socket.AF_INET6)):
    with open(f'/proc/net/{table}', encoding='ascii') as f:
      next(f)
      for line in f:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state != '0A' or inode not in inodes:  # 0A: LISTEN
          continue
        address, port = local.split(':')
        # Words of the address in host (little-endian) byte order.
        packed = b''.join(bytes.fromhex(address[i:i + 8])[::-1]
                          for i in range(0, len(address), 8))
        host = socket.inet_ntop(family, packed)
        found.append(f'{host}:{int(port, 16)}')
  yield sorted(found)


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='reads /proc, as ss does; Linux only')
def test_fn_api_servers_of_a_process_harness_listen_on_loopback_only(tmp_path):
  # The hardening issue, defect 9: Beam's GrpcServer binds '[::]:0', so the
  # unauthenticated Fn API listened on every interface.
  out = str(tmp_path / 'listening')
  with beam.Pipeline(options=PipelineOptions(PROCESS)) as p:
    _ = (p | beam.Create([0]) | beam.FlatMap(_parent_listening_addresses)
         | beam.Map(repr) | beam.io.WriteToText(out))
  import glob
  import ast
  addresses = [a for path in glob.glob(out + '*')
               for line in open(path, encoding='utf-8')
               for a in ast.literal_eval(line)]
  # Control, data, state and logging at least.
  assert len(addresses) >= 4, addresses
  # IPv4 loopback, possibly as IPv4-mapped IPv6 (gRPC's dual-stack
  # sockets): never 0.0.0.0 or ::.
  assert all(a.removeprefix('::ffff:').startswith('127.')
             for a in addresses), addresses


def _die_once(x, marker):
  """Ends the harness's process the first time it sees 2 (the marker file
  says whether it did)."""
  import os
  if x == 2 and not os.path.exists(marker):
    open(marker, 'w').close()
    os._exit(3)
  return x


def _worker_pool(path_first=None):
  """Beam's worker pool, each harness in a process of its own, started
  with ``python`` from PATH; returns (process, port)."""
  import socket
  import subprocess
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = dict(os.environ)
  # The harnesses import this module (its functions are pickled by name).
  env['PYTHONPATH'] = os.pathsep.join(
      [os.path.dirname(os.path.abspath(__file__)), env.get('PYTHONPATH', '')])
  if path_first is not None:
    env['PATH'] = os.pathsep.join([path_first, env.get('PATH', '')])
  pool = subprocess.Popen(
      [sys.executable, '-m', 'apache_beam.runners.worker.worker_pool_main',
       f'--service_port={port}'], env=env)
  # Serving once it accepts connections (importing Beam takes seconds; a
  # warm Spark asks for a harness at once).
  import time
  deadline = time.monotonic() + 60
  while True:
    try:
      with socket.create_connection(('127.0.0.1', port), timeout=1):
        break
    except OSError:
      if pool.poll() is not None or time.monotonic() > deadline:
        pool.kill()
        raise RuntimeError(f'the worker pool did not start ({pool.poll()})')
      time.sleep(0.2)
  return pool, port


def _external(port):
  return PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner', '--spark_master_url=local[2]',
      '--environment_type=EXTERNAL', f'--environment_config=localhost:{port}'])


def test_an_external_harness_that_goes_away_is_replaced_not_waited_for(
    tmp_path, client_log):
  # The runner has no process of the harness to watch, only its control
  # stream, which ends when the process dies.
  pool, port = _worker_pool(os.path.dirname(sys.executable))
  try:
    marker = str(tmp_path / 'died')
    with beam.Pipeline(options=_external(port)) as p:
      out = (p | beam.Create([1, 2, 3]) | beam.Reshuffle()
             | beam.Map(_die_once, marker=marker))
      assert_that(out, equal_to([1, 2, 3]))
    assert os.path.exists(marker)  # it did die, and the job still ended
    assert any('closed its' in m and 'retrying it once' in m
               for _, m in client_log.seen), client_log.seen
  finally:
    pool.kill()
    pool.wait()


_NEVER_CONNECTS = """
import sys
import apache_beam as beam
from test_fn_api import _external
p = beam.Pipeline(options=_external(int(sys.argv[1])))
_ = p | beam.Create([1, 2]) | beam.Map(str)
p.run().wait_until_finish()
"""


def test_an_external_harness_that_never_connects_fails_the_job(tmp_path):
  # The pool's ``python`` cannot start a harness: it dies before it
  # connects, and the pool says nothing. A fresh program, so that its Spark
  # workers inherit the short timeout (a worker reads it when it starts).
  import subprocess
  fake = tmp_path / 'bin'
  fake.mkdir()
  (fake / 'python').write_text('#!/bin/sh\nexit 1\n')
  (fake / 'python').chmod(0o755)
  pool, port = _worker_pool(str(fake))
  try:
    run = subprocess.run(
        [sys.executable, '-c', _NEVER_CONNECTS, str(port)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, 'BEAM_PYSPARK_HARNESS_CONNECT_SECS': '5',
             'PYTHONPATH': os.path.dirname(os.path.abspath(__file__))})
  finally:
    pool.kill()
    pool.wait()
  assert run.returncode != 0
  assert 'never connected' in run.stderr, run.stderr[-3000:]
