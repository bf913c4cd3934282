"""The Connect engine (beam_pyspark/connect/) against the RDD engine.

A Spark Connect server (tests/connect_server.py: Spark's own plugin over
local[2]) and a client process with no working JVM and PySpark in its
Connect-only mode (as ``pyspark-client`` alone) run tests/connect_jobs.py:
Beam's WordCount and a pipeline of GroupByKey, combines, side inputs,
Flatten, a stateful DoFn, Reshuffle and a counter; the same script on the
RDD engine (local[2]), at the same time in another process, must produce
the same. One server and one run of each, asserting several things.
"""
import json
import os
import subprocess
import sys

from connect_server import ConnectServer
from connect_server import client_environment

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, 'connect_jobs.py')


def _start(out: str, flags: list[str], env: dict) -> subprocess.Popen:
  os.makedirs(out, exist_ok=True)
  log = open(os.path.join(out, 'log.txt'), 'wb')  # pylint: disable=consider-using-with
  return subprocess.Popen([sys.executable, JOBS, out] + flags, cwd=HERE,
                          env=env, stdout=log, stderr=subprocess.STDOUT)


def _results(proc: subprocess.Popen, out: str, timeout: float = 600) -> dict:
  code = proc.wait(timeout=timeout)
  with open(os.path.join(out, 'log.txt'), encoding='utf-8',
            errors='replace') as f:
    log = f.read()
  assert code == 0, f'{proc.args} exited with {code}:\n{log[-6000:]}'
  with open(os.path.join(out, 'results.json'), encoding='utf-8') as f:
    return json.load(f), log


def test_connect_engine_computes_what_the_rdd_engine_does(tmp_path):
  rdd_out = str(tmp_path / 'rdd')
  rdd = _start(rdd_out, ['--spark_master_url=local[2]'], dict(os.environ))
  server = None
  try:
    server = ConnectServer(str(tmp_path / 'server'))
    connect_out = str(tmp_path / 'connect')
    connect = _start(connect_out,
                     [f'--spark_remote={server.url}', '--cancel'],
                     client_environment())
    on_rdd, _ = _results(rdd, rdd_out)
    over_connect, log = _results(connect, connect_out)
    # The client was a Connect-only one, and the jobs ran over Connect.
    assert over_connect.pop('remote_only') is True
    assert on_rdd.pop('remote_only') is False
    assert f'on Spark Connect {server.url}' in log
    cancelled = over_connect.pop('cancelled')
    assert over_connect == on_rdd
    # WordCount's output, a counter's committed value, the combines, side
    # inputs and the stateful DoFn (each key's last count) are all there.
    assert 'the: 32' in on_rdd['wordcount']
    assert on_rdd['scaled'] == 2000
    assert on_rdd['grouped'] == on_rdd['lifted'] and len(on_rdd['grouped']) == 13
    assert "('k99', 1)" in on_rdd['counted']
    assert on_rdd['listed'] == ['a:2000', 'b:2000', 'c:2000']
    # A cancel interrupts the Spark job under way (interruptTag): the
    # ten-minute task ends with it.
    assert cancelled['state'] == 'CANCELLED', cancelled
    assert cancelled['secs'] < 60, cancelled
    _check_partition_values(server.url)
  finally:
    if rdd.poll() is None:
      rdd.kill()
    if server is not None:
      server.stop()


def _check_partition_values(url: str) -> None:
  """connect.partitions' Murmur3 is Spark's, and each target value lands
  in its partition under repartition(n, 'part')."""
  from pyspark.sql.connect import functions as f
  from pyspark.sql.connect.session import SparkSession
  from beam_pyspark.connect.partitions import spark_hash_int
  from beam_pyspark.connect.partitions import targets
  spark = SparkSession.builder.remote(url).create()
  try:
    hashed = spark.sql(
        'SELECT id, hash(CAST(id AS INT)) AS h FROM range(-50, 500)').collect()
    assert [spark_hash_int(r.id) for r in hashed] == [r.h for r in hashed]
    for n in (2, 7):
      rows = spark.createDataFrame(
          [(v,) for v in targets(n)], 'part int').repartition(n, 'part').select(
              'part', f.spark_partition_id().alias('p')).collect()
      assert sorted((targets(n).index(r.part), r.p) for r in rows) == [
          (p, p) for p in range(n)]
  finally:
    spark.stop()


def test_streaming_over_connect_is_refused_at_submission(tmp_path):
  """Refused before anything runs (no server needed: the endpoint is
  never reached), saying why and what to do."""
  out = str(tmp_path / 'streaming')
  proc = _start(out, ['--streaming', '--spark_remote=sc://127.0.0.1:9'],
                client_environment())
  results, _ = _results(proc, out, timeout=300)
  error = results['streaming']
  assert 'do not run over Spark Connect' in error, error
  assert 'foreachBatch' in error and '--spark_remote' in error, error
