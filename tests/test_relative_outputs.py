"""A file output named by a relative path, where tasks run in another
directory (over Spark Connect: the server's session directory; on a
cluster: each executor's), is refused before the job runs: over Connect
``--output out/x`` was written under ``/tmp/spark-*/userFiles-*/`` and the
job ended DONE with the program's ``out/`` empty."""

import apache_beam as beam
import pytest
from apache_beam.io import fileio
from apache_beam.options.pipeline_options import PipelineOptions

from beam_pyspark.errors import UnsupportedPipelineError
from beam_pyspark.execution import check_outputs
from beam_pyspark.options import RunnerOptions
from beam_pyspark.planning import relpaths


def _writes(*paths, files=None):
  p = beam.Pipeline()
  pc = p | beam.Create(['a'])
  for i, path in enumerate(paths):
    _ = pc | f'write{i}' >> beam.io.WriteToText(path)
  if files:
    _ = pc | 'files' >> fileio.WriteToFiles(path=files)
  return p.to_runner_api()


def test_each_relative_output_is_found_once_by_its_transform():
  proto = _writes('out/x', '/abs/y', 'gs://bucket/z', files='rel/dir')
  assert sorted(relpaths.relative_outputs(proto)) == [
      ('files', 'rel/dir'), ('write0', 'out/x')]
  assert relpaths.relative_outputs(_writes('/abs/y', 's3://b/k')) == []


def test_refused_over_connect_and_on_a_cluster_not_on_local_spark(
    monkeypatch):
  for name in ('SPARK_REMOTE', 'SPARK_CONNECT_MODE_ENABLED'):
    monkeypatch.delenv(name, raising=False)
  proto = _writes('out/x')
  check_outputs(proto, RunnerOptions())  # local: this process's directory
  check_outputs(proto, RunnerOptions(master='local[2]'))
  check_outputs(_writes('/abs/x'), RunnerOptions(remote='sc://h:15002'))
  with pytest.raises(UnsupportedPipelineError,
                     match=r"write0 writes to 'out/x', a relative path: over "
                     "Spark Connect the tasks run in the server's session"):
    check_outputs(proto, RunnerOptions(remote='sc://h:15002'))
  with pytest.raises(UnsupportedPipelineError,
                     match="on spark://h:7077 the tasks run in each "
                     "executor's working directory"):
    check_outputs(proto, RunnerOptions(master='spark://h:7077'))


def test_the_runner_refuses_before_reaching_the_server(tmp_path):
  """Nothing listens at the endpoint: the refusal comes first, with what
  to do."""
  p = beam.Pipeline(options=PipelineOptions([
      '--runner=beam_pyspark.PySparkRunner',
      '--spark_remote=sc://127.0.0.1:9']))
  _ = p | beam.Create(['a']) | beam.io.WriteToText('out/relative')
  with pytest.raises(UnsupportedPipelineError,
                     match='Give an absolute path'):
    p.run()


def _reads(*patterns):
  p = beam.Pipeline()
  for i, pattern in enumerate(patterns):
    _ = p | f'read{i}' >> beam.io.ReadFromText(pattern, validate=False)
  return p.to_runner_api()


def test_a_relative_input_is_refused_as_an_output_is(monkeypatch):
  """Beam checks ReadFromText's pattern in the client's directory; the
  tasks then read in theirs (over Connect: FileNotFoundError mid-job)."""
  for name in ('SPARK_REMOTE', 'SPARK_CONNECT_MODE_ENABLED'):
    monkeypatch.delenv(name, raising=False)
  proto = _reads('data/in*.txt', '/abs/in.txt', 'gs://b/in.txt',
                 'data/in*.txt')
  assert relpaths.relative_inputs(proto) == [('read0', 'data/in*.txt')]
  assert relpaths.relative_outputs(proto) == []
  check_outputs(proto, RunnerOptions(master='local[2]'))
  with pytest.raises(UnsupportedPipelineError,
                     match=r"read0 reads 'data/in\*.txt', a relative path: "
                     "over Spark Connect the tasks run in the server's"):
    check_outputs(proto, RunnerOptions(remote='sc://h:15002'))
  check_outputs(_reads('/abs/x'), RunnerOptions(master='spark://h:7077'))
