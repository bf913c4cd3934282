"""Twenty clients at once against one job server, two rounds (issue 26).

In a round of twenty concurrent WordCounts, one job was lost: its
preparation counted against the history of ten ended jobs and was dropped
while others prepared, its staged files removed 8 s after staging, and
its Run answered NOT_FOUND. Here twenty threads each run Beam's own
``apache_beam.examples.wordcount`` through Beam's PortableRunner against
one real ``beam-pyspark job-server`` (default history of ten), each
staging a file of its own (``--files_to_stage``), and every round every
output must be the input's counts. Kept light: a few lines of input, the
clients in one process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import glob
import threading

import pytest
from apache_beam.examples import wordcount
from apache_beam.portability.api import beam_job_api_pb2

from jobserver_process import JobServerProcess

CLIENTS = 20
# Two rounds: 40 jobs, four times the history of ten ended jobs, the
# second round's preparations made while the first's end (a third round
# added 55 s of CI and nothing a second does not).
ROUNDS = 2
LINES = [f'round {i} the quick brown fox jumps over the lazy dog {i % 3}'
         for i in range(12)]


def _expected() -> dict[str, int]:
  counts = collections.Counter()
  for line in LINES:
    counts.update(line.split())
  return dict(counts)


def _counts(prefix: str) -> dict[str, int]:
  counts = {}
  for path in glob.glob(prefix + '*'):
    with open(path, encoding='utf-8') as f:
      for line in f:
        word, count = line.rsplit(': ', 1)
        counts[word] = int(count)
  return counts


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  server = JobServerProcess(tmp_path_factory.mktemp('clients') / 'server')
  yield server
  server.stop()


def test_a_preparation_outlives_ten_others(server):
  """Client A prepares, ten others prepare, A's Run runs (it answered
  NOT_FOUND when preparations counted against the history of ten)."""
  from test_registry import _pipeline
  done = beam_job_api_pb2.JobState.DONE

  def prepare(name):
    return server.job_stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
        pipeline=_pipeline(), job_name=name)).preparation_id

  first = prepare('a')
  others = [prepare(f'other-{i}') for i in range(10)]
  server.job_stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=first))
  for event in server.job_stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id=first), timeout=300):
    if event.state in (done, beam_job_api_pb2.JobState.FAILED):
      break
  assert event.state == done, server.log()
  for job_id in others:  # still there, and cancellable
    assert server.job_stub.Cancel(beam_job_api_pb2.CancelJobRequest(
        job_id=job_id)).state == beam_job_api_pb2.JobState.CANCELLED


def test_twenty_concurrent_wordcounts_two_rounds_all_correct(
    server, tmp_path):
  source = tmp_path / 'input.txt'
  source.write_text('\n'.join(LINES) + '\n')
  expected = _expected()
  start = threading.Barrier(CLIENTS)

  def client(round_, i):
    staged = tmp_path / f'note-{round_}-{i}.txt'
    staged.write_text(f'client {i} of round {round_}\n')
    output = str(tmp_path / f'out-{round_}-{i}' / 'counts')
    start.wait(60)
    wordcount.run([
        '--runner=PortableRunner', f'--job_endpoint={server.job_endpoint}',
        '--environment_type=beam:env:embedded_python:v1',
        f'--job_name=wc-{round_}-{i}', f'--files_to_stage={staged}',
        # One partition per shuffle: the clients' concurrency is the point,
        # not each job's parallelism (half the tasks on 2 shared cores).
        '--spark_parallelism=1',
        f'--input={source}', f'--output={output}'], save_main_session=False)
    return output

  for round_ in range(ROUNDS):
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
      futures = [pool.submit(client, round_, i) for i in range(CLIENTS)]
    # Every client's end, then one assertion naming each failure: a CI
    # failure of this test once said only its first exception.
    raised = {i: repr(f.exception())[:2000] for i, f in enumerate(futures)
              if f.exception() is not None}
    assert not raised, (
        f'round {round_}: {len(raised)} clients raised: {raised}\n'
        f'{server.log()[-8000:]}')
    outputs = [f.result() for f in futures]
    wrong = {o: c for o in outputs if (c := _counts(o)) != expected}
    assert not wrong, (f'round {round_}: {len(wrong)} wrong outputs: {wrong}'
                       f' (expected {expected})\n{server.log()[-8000:]}')
  jobs = server.job_stub.GetJobs(beam_job_api_pb2.GetJobsRequest()).job_info
  # The history keeps the last ten ended jobs, all DONE.
  assert len(jobs) == 10, [(j.job_name, j.state) for j in jobs]
  assert {j.state for j in jobs} == {beam_job_api_pb2.JobState.DONE}, [
      (j.job_name, j.state) for j in jobs]
  assert 'NOT_FOUND' not in server.log()


def test_one_client_filling_its_share_leaves_room_for_others(tmp_path):
  """Preparations are bounded per client host (half of --max-preparations
  by default): one client preparing without end used to take every slot
  and lock the others out until its preparations expired (30 min). The
  two clients here are two hosts to the server: 127.0.0.1 and [::1]."""
  import grpc
  from apache_beam.portability.api import beam_job_api_pb2_grpc
  from test_registry import _pipeline
  server = JobServerProcess(tmp_path / 'server', '--max-preparations', '6')
  port = server.job_endpoint.rsplit(':', 1)[1]
  channels = [grpc.insecure_channel(f'127.0.0.1:{port}'),
              grpc.insecure_channel(f'[::1]:{port}')]
  try:
    greedy, other = (beam_job_api_pb2_grpc.JobServiceStub(c)
                     for c in channels)

    def prepare(stub, name):
      return stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
          pipeline=_pipeline(), job_name=name), timeout=60).preparation_id

    hoard = [prepare(greedy, f'hoard-{i}') for i in range(3)]
    with pytest.raises(grpc.RpcError) as info:
      prepare(greedy, 'one-too-many')
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert '127.0.0.1' in info.value.details()
    assert '--max-preparations-per-client 3' in info.value.details()
    # The other client's share is whole.
    assert len({prepare(other, f'other-{i}') for i in range(3)}) == 3
    # A preparation cancelled frees its client's slot.
    greedy.Cancel(beam_job_api_pb2.CancelJobRequest(job_id=hoard[0]))
    assert prepare(greedy, 'again')
  finally:
    for channel in channels:
      channel.close()
    server.stop()
