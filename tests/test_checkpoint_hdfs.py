"""Streaming checkpoints on HDFS (issue 31).

Apache Hadoop's MiniDFSCluster on loopback, started as `beam-pyspark local
hdfs` (docs/local-services.md): the runner's Python side reaches it
through WebHDFS (Beam's --hdfs_host and --hdfs_port), Spark's JVM through
Hadoop's own client (hdfs://). The store's guarantees (a whole file or
none, a manifest committed once: an HDFS rename never replaces), then a
real job server SIGKILLed under a streaming job (an unbounded splittable
read over many micro-batches into windowed sums, an idempotent sink) whose
checkpoint, Spark's query checkpoint included, is on HDFS: the server's
next start resumes the job from HDFS, and its output equals Beam's
DirectRunner's. S3 and a driver killed mid-batch: test_checkpoint_s3.py.
Last, the README's streaming example checkpointed on the same store under
load: its query's first start fails as on a loaded machine, while every
core is busy (tests/cpu_load.py).
"""

from __future__ import annotations

import os
import re
import sys
import time
import uuid

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2

from checkpoint_store_checks import check_checkpoint_dir
from checkpoint_store_checks import check_store
from checkpoint_store_checks import location
from cpu_load import busy_cores
from cpu_load import run_logged
from cpu_load import slow_first_source_python
from jobserver_process import JobServerProcess
from local_command import LocalCommand
import streaming_recovery_job as job

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLE = os.path.join(REPO, 'examples', 'streaming_counts.py')
sys.path.insert(0, os.path.join(REPO, 'examples'))
from streaming_counts import WORDS  # pylint: disable=wrong-import-position
# The example's source: 40 events over 4 s.
SECONDS, RATE = 4, 10
_FILE = re.compile(r'(\S+)-(\d{5})-of-(\d{5})\.txt$')
EMBEDDED = 'beam:env:embedded_python:v1'
RESUMED = 'Resumed from its checkpoint after the job server restarted: '
JobState = beam_job_api_pb2.JobState


@pytest.fixture(scope='module')
def hdfs(tmp_path_factory):
  """`beam-pyspark local hdfs` as the docs start it: these tests use the
  location and options it prints, and Ctrl-C stops it cleanly at the end
  (docs/local-services.md; one MiniDFSCluster for both purposes)."""
  command = LocalCommand('hdfs', '--port', '0', '--http-port', '0', '--dir',
                         str(tmp_path_factory.mktemp('hdfs')))
  try:
    yield command.pasted()
  finally:
    command.interrupt()


def test_a_store_on_hdfs_writes_whole_files_and_commits_each_name_once(hdfs):
  check_store(hdfs)


def test_a_checkpoint_on_hdfs_resumes_from_its_manifests(hdfs):
  check_checkpoint_dir(hdfs)


def _committed(store) -> list[int]:
  return sorted(int(n) for n in store.listdir('manifests') if n.isdigit())


def test_a_job_server_killed_resumes_its_streaming_job_from_hdfs(
    tmp_path, hdfs):
  reference = tmp_path / 'direct'
  reference.mkdir()
  with beam.Pipeline('DirectRunner') as p:
    job.build_sums(p, str(reference))
  expected = job.read_output(str(reference))
  assert len(expected) > 20
  root, out = tmp_path / 'server', tmp_path / 'out'
  out.mkdir()
  path = f'server-{uuid.uuid4().hex[:8]}'
  url, store = hdfs.url(path), location(hdfs, path).store()
  first = JobServerProcess(root, env={'PYTHONPATH': HERE})
  try:
    p = beam.Pipeline(options=PipelineOptions([
        '--runner=PortableRunner', f'--job_endpoint={first.job_endpoint}',
        f'--environment_type={EMBEDDED}', '--streaming',
        f'--max_records_per_batch={job.SDF_BUDGET}', '--job_name=on-hdfs',
        f'--checkpoint_location={url}', *hdfs.options]))
    job.build_sums(p, str(out))
    job_id = p.run()._job_id  # pylint: disable=protected-access
    deadline = time.monotonic() + 240
    while not [b for b in _committed(store) if b > 0]:
      assert first.proc.poll() is None, first.log()
      assert time.monotonic() < deadline, first.log()
      time.sleep(0.1)
    first.proc.kill()  # the driver dies: SIGKILL, no goodbye
    first.proc.wait(30)
  finally:
    first.stop()
  killed_at = max(_committed(store))
  # Spark's own query checkpoint is on HDFS too.
  assert store.listdir('query/offsets'), store.files('')

  second = JobServerProcess(root, env={'PYTHONPATH': HERE})
  try:
    deadline = time.monotonic() + 240
    while True:
      state = second.job_stub.GetState(
          beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
      if state == JobState.DONE:
        break
      assert state in (JobState.STARTING, JobState.RUNNING), second.log()
      assert time.monotonic() < deadline, second.log()
      time.sleep(0.5)
    texts = [
        r.message_response.message_text
        for r in second.job_stub.GetMessageStream(
            beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=60)
        if r.HasField('message_response')]
  finally:
    second.stop()
  resumed = [t for t in texts if t.startswith(RESUMED)]
  assert resumed and url in resumed[-1], texts
  assert int(resumed[-1].split('micro-batch ')[1].split()[0]) >= killed_at
  assert job.read_output(str(out)) == expected
  assert not store.isdir(''), 'a DONE job keeps no checkpoint'


def test_the_readme_streaming_example_on_hdfs_is_exact_with_every_core_busy(
    tmp_path, hdfs):
  """The README's streaming example (examples/streaming_counts.py, in a
  process of its own as a user runs it), checkpointed on HDFS (Spark's
  query checkpoint too), while CPU-bound processes (cpu_load) keep both
  cores busy.
  Its query's first start fails as Spark's own does on a loaded machine
  (the source's Python process does not connect back within Spark's 10 s,
  cpu_load.slow_first_source_python): the job starts it again after a
  pause, says why, and counts every event of its source once."""
  out = tmp_path / 'counts'
  path = f'loaded-{uuid.uuid4().hex[:8]}'
  url, store = hdfs.url(path), location(hdfs, path).store()
  env = dict(os.environ, PYSPARK_PYTHON=slow_first_source_python(
      str(tmp_path)))
  with busy_cores():
    code, log = run_logged(
        [sys.executable, EXAMPLE, '--output', str(out),
         '--runner=beam_pyspark.PySparkRunner', '--streaming',
         '--spark_master_url=local[2]', f'--seconds={SECONDS}',
         f'--rate={RATE}', f'--checkpoint_location={url}', *hdfs.options],
        str(tmp_path / 'driver.log'), timeout=900, cwd=REPO, env=env)
  # Why it failed: Python's lines, not the JVM's frames around them.
  assert code == 0, '\n'.join(
      line for line in log.splitlines()
      if not line.startswith('\t') and 'Broken pipe' not in line)[-6000:]
  assert (tmp_path / 'slow-source').is_dir(), 'the first start was not slow'
  restarts = [line for line in log.splitlines() if 'did not start' in line]
  print(f'{len(restarts)} restarts of the query')
  assert restarts, log[-6000:]
  assert 'connect back within Spark\'s fixed 10 s' in restarts[0]
  assert 'Starting it again in 2 s (start 2)' in restarts[0], restarts
  assert 'Thread State' not in log, log[-6000:]
  counts = example_counts(str(out))
  # Every event of the source counted once: none lost, none twice.
  assert sum(counts.values()) == SECONDS * RATE, (counts, log[-3000:])
  assert not store.isdir(''), 'a DONE job keeps no checkpoint'


def example_counts(output: str) -> dict:
  """{(window, word): count} of the streaming example's files; a window's
  count of a word is one line in one of its files."""
  counts: dict = {}
  for name in sorted(os.listdir(output)):
    if name.startswith('.'):  # fileio's temporary directory
      continue
    window = _FILE.search(name).group(1)
    with open(os.path.join(output, name), encoding='utf-8') as f:
      for line in f.read().splitlines():
        word, count = line.split(': ')
        assert word in WORDS, line
        assert (window, word) not in counts, (name, line)
        counts[window, word] = int(count)
  return counts
