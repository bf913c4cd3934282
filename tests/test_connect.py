"""The Connect engine (beam_pyspark/connect/) against the RDD engine.

A Spark Connect server (tests/connect_server.py: Spark's own plugin over
local[2]) and a client process with no working JVM and only what
``pyspark-client`` alone gives (tests/connect_client: no py4j, no
pyspark.core; asserted to start no JVM) run tests/connect_jobs.py:
Beam's WordCount, a pipeline of GroupByKey, combines, side inputs,
Flatten, a stateful DoFn, Reshuffle and a counter, and the
DataFrame example of the README and docs/guide/running.md; the same pipelines on
the RDD engine (local[2], in the test process, while the server starts)
must produce the same. One run of each, asserting several things; the
server is the process's shared one (connect_server.shared).
"""
import json
import os
import subprocess
import sys

from conftest import SPARK_MASTER
import connect_server
from connect_server import client_environment
from connect_server import started_programs
import connect_jobs
from beam_pyspark.connect.engine import SESSION_CONF

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, 'connect_jobs.py')


def _start(out: str, flags: list[str], env: dict,
           python: str = sys.executable) -> subprocess.Popen:
  os.makedirs(out, exist_ok=True)
  log = open(os.path.join(out, 'log.txt'), 'wb')  # pylint: disable=consider-using-with
  return subprocess.Popen([python, JOBS, out] + flags, cwd=HERE,
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
  server = connect_server.shared(wait=False)
  connect = None
  try:
    rdd_out = str(tmp_path / 'rdd')
    os.makedirs(rdd_out)
    connect_jobs.main([rdd_out, f'--spark_master_url={SPARK_MASTER}'])
    with open(os.path.join(rdd_out, 'results.json'), encoding='utf-8') as f:
      on_rdd = json.load(f)
    server.wait()
    connect_out = str(tmp_path / 'connect')
    audit = str(tmp_path / 'client-processes.txt')
    connect = _start(connect_out,
                     [f'--spark_remote={server.url}', '--cancel'],
                     client_environment(audit),
                     connect_server.client_python())
    over_connect, log = _results(connect, connect_out)
    # The client was PyPI's pyspark-client, the version the docs name (no
    # 4.3 of it exists), against Spark 4.3's server; Connect-only (no
    # py4j, no pyspark.core), it started no JVM, and the jobs ran over
    # Connect.
    client, client_version = over_connect.pop('pyspark')
    assert (client, client_version[:4]) == ('pyspark-client', '4.2.'), (
        client, client_version)
    assert on_rdd.pop('pyspark')[0] == 'pyspark'
    assert over_connect.pop('remote_only') is True
    assert on_rdd.pop('remote_only') is False
    assert over_connect.pop('jvm_modules') == []
    assert 'py4j' in on_rdd.pop('jvm_modules')
    started_programs(audit)
    assert f'on Spark Connect {server.url}' in log
    cancelled = over_connect.pop('cancelled')
    # The Arrow batch settings the engine gives the session while its jobs
    # run are Spark's own again after them.
    restored = over_connect.pop('session_conf')
    assert restored['spark.sql.execution.arrow.maxRecordsPerBatch'] == '10000'
    assert all(restored[k] != v for k, v in SESSION_CONF.items()), restored
    assert over_connect == on_rdd
    # WordCount's output, a counter's committed value, the combines, side
    # inputs and the stateful DoFn (each key's last count) are all there.
    assert 'the: 32' in on_rdd['wordcount']
    assert on_rdd['scaled'] == 2000
    assert on_rdd['grouped'] == on_rdd['lifted'] and len(on_rdd['grouped']) == 13
    assert "('k99', 1)" in on_rdd['counted']
    assert on_rdd['listed'] == ['a:2000', 'b:2000', 'c:2000']
    totals = [line for line in on_rdd['dataframe']
              if not line.startswith('region')]  # (a header per shard)
    assert sorted(totals) == [
        f'r{r},{sum(range(r, 300, 4))}' for r in range(4)], on_rdd['dataframe']
    # A cancel interrupts the Spark job under way (interruptTag): the
    # ten-minute task ends with it.
    assert cancelled['state'] == 'CANCELLED', cancelled
    assert cancelled['secs'] < 60, cancelled
    _check_partition_values(server.url)
  finally:
    if connect is not None and connect.poll() is None:
      connect.kill()


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
  audit = str(tmp_path / 'client-processes.txt')
  proc = _start(out, ['--streaming', '--spark_remote=sc://127.0.0.1:9'],
                client_environment(audit))
  results, _ = _results(proc, out, timeout=300)
  started_programs(audit)
  error = results['streaming']
  assert 'do not run over Spark Connect' in error, error
  assert 'foreachBatch' in error and '--spark_remote' in error, error


def test_engine_choice_follows_pyspark(monkeypatch):
  """--spark_remote, else SPARK_REMOTE, else PySpark's Connect mode picks
  the Connect engine for batch; nothing of it, the RDD engine; streaming
  over Connect is refused with the reason (engine.check_engine)."""
  import apache_beam as beam
  import pytest
  from beam_pyspark import engine
  from beam_pyspark.errors import UnsupportedPipelineError
  from beam_pyspark.options import RunnerOptions
  p = beam.Pipeline()
  _ = p | beam.Create([1])
  proto = p.to_runner_api()
  for name in ('SPARK_REMOTE', 'SPARK_CONNECT_MODE_ENABLED'):
    monkeypatch.delenv(name, raising=False)
  assert engine.check_engine(proto, RunnerOptions()) == engine.BATCH
  assert engine.check_engine(
      proto, RunnerOptions(remote='sc://h:15002')) == engine.CONNECT
  monkeypatch.setenv('SPARK_REMOTE', 'sc://h:15002')
  assert engine.check_engine(proto, RunnerOptions()) == engine.CONNECT
  monkeypatch.delenv('SPARK_REMOTE')
  monkeypatch.setenv('SPARK_CONNECT_MODE_ENABLED', '1')
  assert engine.check_engine(proto, RunnerOptions()) == engine.CONNECT
  with pytest.raises(UnsupportedPipelineError, match='foreachBatch'):
    engine.check_engine(proto, RunnerOptions(streaming=True))
  # A drained job is batch, so it runs over Connect.
  assert engine.check_engine(
      proto, RunnerOptions(streaming=True, drain=True)) == engine.CONNECT
