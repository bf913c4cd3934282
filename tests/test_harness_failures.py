"""Nothing lost: a stage whose SDK harness cannot start, dies in the middle
of a bundle or never connects ends its job FAILED, with the harness's own
last words first in the job's messages, or DONE with exactly the reference
output after a retry; never DONE with fewer records (issues 39 and 40).

Real parts: a job server (local[2]) per module, pipelines submitted over the
Job API, PROCESS environments whose commands are scripts written here (a
boot that says why it gives up and exits 3, one that never connects) or
Beam's own Python harness, killed with SIGKILL by the test mid-bundle.
A pipeline's ParDo alone runs in the PROCESS environment, the rest in the
embedded one, where the stages after it take the fast path in the same
Spark task: the shape whose failed boot ended DONE with 0 of its 20 lines.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import time

import apache_beam as beam
import pytest
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.transforms import environments

from jobserver_process import JobServerProcess

JobState = beam_job_api_pb2.JobState
Importance = beam_job_api_pb2.JobMessage.MessageImportance
LINES = [f'line {i}' for i in range(20)]
# A harness that never connects is given up after this long (the default,
# 180 s, is for JVMs loading a classpath on a loaded machine).
CONNECT_SECS = 20
# Generous: a job here takes 10-30 s on 2 shared cores.
JOB_SECS = 240


# A connected harness answering nothing is given up after this long (the
# default, 600 s, leaves a harness busy in a JVM's full collections alone).
UNRESPONSIVE_SECS = 15


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  server = JobServerProcess(
      tmp_path_factory.mktemp('harness-failures') / 'artifacts',
      env={'BEAM_PYSPARK_HARNESS_CONNECT_SECS': str(CONNECT_SECS),
           'BEAM_PYSPARK_HARNESS_UNRESPONSIVE_SECS': str(UNRESPONSIVE_SECS)})
  try:
    yield server
  finally:
    server.stop()


def _script(path, text: str) -> str:
  path.write_text('#!/bin/sh\n' + text)
  path.chmod(0o755)
  return str(path)


def _pipeline(out: str, bang, command: str, whole: bool
              ) -> beam_runner_api_pb2.Pipeline:
  """Create(LINES) | 'Bang' >> Map(bang) | WriteToText(out): 'Bang' alone
  in a PROCESS environment running ``command`` (``whole``: every
  transform)."""
  p = beam.Pipeline()
  _ = (p | beam.Create(LINES) | 'Bang' >> beam.Map(bang)
       | beam.io.WriteToText(out))
  proto = p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default())
  envs = proto.components.environments
  (default_id, ) = [e for e in envs if envs[e].urn ==
                    'beam:env:embedded_python:v1']
  process = beam_runner_api_pb2.Environment()
  process.CopyFrom(envs[default_id])
  process.urn = common_urns.environments.PROCESS.urn
  process.payload = beam_runner_api_pb2.ProcessPayload(
      command=command).SerializeToString()
  if whole:
    envs[default_id].CopyFrom(process)
    return proto
  envs['process'].CopyFrom(process)
  (bang_id, ) = [t for t, transform in proto.components.transforms.items()
                 if transform.unique_name == 'Bang']
  proto.components.transforms[bang_id].environment_id = 'process'
  return proto


def _run(server, proto, name: str, timeout: float = JOB_SECS):
  """Runs the pipeline; (final state, its messages, seconds it took)."""
  stub = server.job_stub
  job_id = stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
      pipeline=proto, job_name=name)).preparation_id
  started = time.monotonic()
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id))
  state = None
  for event in stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id=job_id), timeout=timeout):
    state = event.state
    if state in (JobState.DONE, JobState.FAILED, JobState.CANCELLED):
      break
  took = time.monotonic() - started
  messages = [
      r.message_response for r in stub.GetMessageStream(
          beam_job_api_pb2.JobMessagesRequest(job_id=job_id), timeout=60)
      if r.HasField('message_response')]
  return state, messages, took


def _lines(out: str) -> list[str]:
  found = []
  for path in glob.glob(out + '*'):
    with open(path, encoding='utf-8') as f:
      found.extend(f.read().splitlines())
  return sorted(found)


def _error(messages) -> str:
  errors = [m.message_text for m in messages
            if m.importance == Importance.JOB_MESSAGE_ERROR]
  assert len(errors) == 1, [m.message_text for m in messages]
  return errors[0]


@pytest.mark.parametrize('whole', [False, True], ids=['pardo', 'pipeline'])
def test_a_harness_that_cannot_boot_fails_the_job_with_its_words(
    server, tmp_path, whole):
  boot = _script(tmp_path / 'boot.sh', (
      'echo "test boot: fetching nothing" >&2\n'
      'echo "test boot: the staged files have no harness to run" >&2\n'
      'exit 3\n'))
  out = str(tmp_path / 'out' / 'lines')
  state, messages, took = _run(
      server, _pipeline(out, lambda x: x + '!', boot, whole), 'no-boot')
  texts = [m.message_text for m in messages]
  # Before: with the ParDo alone in it, DONE and no line written.
  assert state == JobState.FAILED, (JobState.Enum.Name(state), _lines(out),
                                    texts)
  assert _lines(out) == []
  error = _error(messages)
  first = error.splitlines()[0]
  assert 'exited with code 3' in first, error
  assert first.endswith(
      'test boot: the staged files have no harness to run'), error
  # Its last lines follow, the earlier one too.
  assert 'test boot: fetching nothing' in error, error
  assert took < JOB_SECS


def test_a_harness_killed_in_a_bundle_is_retried_with_exact_output(
    server, tmp_path):
  pid_file = str(tmp_path / 'harness.pid')

  def bang(x):
    # The first harness to get here writes its pid and waits to be killed;
    # the bundle's retry, on a new harness, finds the file and goes on.
    import os as os_
    import time as time_
    try:
      fd = os_.open(pid_file, os_.O_CREAT | os_.O_EXCL | os_.O_WRONLY)
    except FileExistsError:
      return x + '!'
    os_.write(fd, str(os_.getpid()).encode('ascii'))
    os_.close(fd)
    time_.sleep(600)
    return x + '!'

  command = f'{sys.executable} -m apache_beam.runners.worker.sdk_worker_main'
  out = str(tmp_path / 'out' / 'lines')
  proto = _pipeline(out, bang, command, whole=False)
  import threading
  killed = []

  def kill_when_waiting():
    deadline = time.monotonic() + JOB_SECS
    while time.monotonic() < deadline:
      try:
        with open(pid_file, encoding='ascii') as f:
          pid = int(f.read())
      except (FileNotFoundError, ValueError):
        time.sleep(0.2)
        continue
      os.kill(pid, signal.SIGKILL)
      killed.append(pid)
      return

  killer = threading.Thread(target=kill_when_waiting, daemon=True)
  killer.start()
  state, messages, _ = _run(server, proto, 'killed')
  killer.join(5)
  texts = [m.message_text for m in messages]
  assert killed, texts
  assert state == JobState.DONE, (JobState.Enum.Name(state), texts)
  assert _lines(out) == sorted(f'{line}!' for line in LINES)
  # The retry says why it happened.
  assert any('killed by signal 9 (SIGKILL)' in t and 'retrying' in t
             for t in texts), '\n'.join(texts)


def test_a_harness_that_never_connects_fails_the_job_in_bounded_time(
    server, tmp_path):
  hang = _script(tmp_path / 'hang.sh', (
      'echo "test harness: waiting for a network that is not there" >&2\n'
      'exec sleep 3600\n'))
  out = str(tmp_path / 'out' / 'lines')
  state, messages, took = _run(
      server, _pipeline(out, lambda x: x + '!', hang, whole=False),
      'never-connects')
  texts = [m.message_text for m in messages]
  assert state == JobState.FAILED, (JobState.Enum.Name(state), texts)
  assert _lines(out) == []
  first = _error(messages).splitlines()[0]
  assert 'never connected to the runner' in first, first
  assert first.endswith(
      'test harness: waiting for a network that is not there'), first
  assert CONNECT_SECS <= took < JOB_SECS


# A "harness" that opens its control stream, reads the runner's requests
# and answers none of them.
SILENT_HARNESS = """
import sys
import threading
import grpc
from apache_beam.portability.api import beam_fn_api_pb2_grpc
flags = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)
print('silent harness (test): connected, and answering nothing',
      file=sys.stderr, flush=True)
channel = grpc.insecure_channel(flags['control_endpoint'])
never = threading.Event()
def answers():
  never.wait()
  yield from ()
for request in beam_fn_api_pb2_grpc.BeamFnControlStub(channel).Control(
    answers(), metadata=[('worker_id', flags['id'])]):
  pass
"""


def test_a_harness_that_connects_and_never_answers_fails_the_job(
    server, tmp_path):
  script = tmp_path / 'silent.py'
  script.write_text(SILENT_HARNESS)
  out = str(tmp_path / 'out' / 'lines')
  state, messages, took = _run(
      server, _pipeline(out, lambda x: x + '!',
                        f'{sys.executable} {script}', whole=False),
      'never-answers')
  texts = [m.message_text for m in messages]
  # Before: RUNNING until the test gave up waiting (no bound applied).
  assert state == JobState.FAILED, (JobState.Enum.Name(state), texts)
  assert _lines(out) == []
  first = _error(messages).splitlines()[0]
  assert 'answered no request of the runner' in first, first
  assert first.endswith(
      'silent harness (test): connected, and answering nothing'), first
  assert UNRESPONSIVE_SECS <= took < JOB_SECS


# -- the fast path fed by a stage that fails (no Spark, no job server) --------


def _tag_from(n):
  def tag(x):
    from apache_beam.pvalue import TaggedOutput
    return [TaggedOutput('other', x)] if x >= n else [x]
  return tag


@pytest.mark.parametrize('after, fall_back_at', [
    (0, None),  # the producer fails before its first output
    (3, None),  # ... after some
    (3, 20),  # the loop handed the rest to the harness first
], ids=['at-once', 'midway', 'after-a-fallback'])
def test_a_fast_path_stage_whose_input_fails_fails_with_that_error(
    after, fall_back_at):
  """Before: the loop took its input's failure for its own, handed the
  harness the records it had kept and the harness read on from a producer
  that had ended: an empty or short partition, no error."""
  from beam_pyspark.worker import fastpath
  from beam_pyspark.worker import harnesses
  from beam_pyspark.worker.harnesses import HarnessLostError
  from beam_pyspark.worker.inputs import InputFailed
  from fast_stages import Planned

  fn = _tag_from(fall_back_at) if fall_back_at is not None else (
      lambda x: x + 1)
  stage = Planned(lambda p: (
      p | beam.Create(range(600)) | beam.Reshuffle()
      | 'Suspect' >> beam.Map(fn) | beam.Map(lambda x: (x % 7, x))
      | beam.CombinePerKey(sum)), label='Suspect', inputs=range(600),
                  bundle_bytes=256)
  assert len(stage.inputs) > after + 2

  def producer():
    yield from stage.inputs[:after]
    raise HarnessLostError('the upstream harness went away (test)')

  fast = fastpath.FastStage(stage.runtime, stage.stage, stage.spec,
                            stage.groups, stage.sides,
                            bundle_bytes=stage.bundle_bytes)
  try:
    with pytest.raises(InputFailed) as info:
      for _ in fast.run(producer(), stage.harness, lambda result: None):
        pass
  finally:
    harnesses.release_job(stage.job_id)
  assert isinstance(info.value.cause, HarnessLostError)
  assert 'the upstream harness went away (test)' in str(info.value.cause)
  if fall_back_at is not None:
    assert fast.handover.fallback is not None
