"""The job server through Beam's own PortableRunner client and raw gRPC."""

import glob
import re
import subprocess
import sys
import time

import grpc
import pytest
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_job_api_pb2_grpc
from apache_beam.portability.api import beam_runner_api_pb2

EMBEDDED = 'beam:env:embedded_python:v1'


class Server:
  def __init__(self, artifacts_dir):
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'beam_pyspark.cli', 'job-server',
         '--job-port', '0', '--artifact-port', '0', '--expansion-port', '0',
         '--status-port', '0',
         '--artifacts-dir', str(artifacts_dir), '--spark-master-url',
         'local[2]'],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    self.job_port = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError('job server exited')
      m = re.match(r'Job service listening on .*:(\d+)', line)
      if m:
        self.job_port = int(m.group(1))
      if line.startswith('Artifact service'):
        break
    assert self.job_port
    self.endpoint = f'localhost:{self.job_port}'
    self.channel = grpc.insecure_channel(self.endpoint)
    self.stub = beam_job_api_pb2_grpc.JobServiceStub(self.channel)

  def stop(self):
    self.channel.close()
    self.proc.terminate()
    self.proc.wait(30)


@pytest.fixture(scope='module')
def artifacts_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('jobserver')


@pytest.fixture(scope='module')
def server(artifacts_dir):
  s = Server(artifacts_dir)
  yield s
  s.stop()


def _read(prefix):
  lines = []
  for shard in sorted(glob.glob(prefix + '*')):
    with open(shard, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  return sorted(lines)


def test_portable_runner_wordcount(server, tmp_path):
  text = tmp_path / 'in.txt'
  text.write_text('a b c a\nb a é é\n' * 200, encoding='utf-8')
  out = str(tmp_path / 'out' / 'counts')
  done = subprocess.run([
      sys.executable, '-m', 'apache_beam.examples.wordcount',
      '--runner=PortableRunner', f'--job_endpoint={server.endpoint}',
      f'--environment_type={EMBEDDED}', '--input', str(text),
      '--output', out], capture_output=True, text=True, timeout=300,
      check=False)
  assert done.returncode == 0, (
      f'exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}')
  assert _read(out) == ['a: 600', 'b: 400', 'c: 200', 'é: 400']
  jobs = server.stub.GetJobs(beam_job_api_pb2.GetJobsRequest()).job_info
  assert any(j.state == beam_job_api_pb2.JobState.DONE for j in jobs)


def _code(call):
  with pytest.raises(grpc.RpcError) as info:
    call()
  return info.value.code(), info.value.details()


def test_errors_are_clear_and_isolated(server):
  stub = server.stub
  code, details = _code(lambda: stub.GetState(
      beam_job_api_pb2.GetJobStateRequest(job_id='nope')))
  assert code == grpc.StatusCode.NOT_FOUND and 'nope' in details
  code, _ = _code(lambda: stub.Run(
      beam_job_api_pb2.RunJobRequest(preparation_id='nope')))
  assert code == grpc.StatusCode.NOT_FOUND
  code, _ = _code(lambda: list(stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id='nope'))))
  assert code == grpc.StatusCode.NOT_FOUND
  # A malformed pipeline: a transform reading a PCollection that does not
  # exist.
  bad = beam_runner_api_pb2.Pipeline()
  bad.root_transform_ids.append('t')
  bad.components.transforms['t'].unique_name = 't'
  bad.components.transforms['t'].spec.urn = 'beam:transform:group_by_key:v1'
  bad.components.transforms['t'].inputs['in'] = 'missing'
  code, details = _code(lambda: stub.Prepare(
      beam_job_api_pb2.PrepareJobRequest(job_name='bad', pipeline=bad)))
  assert code == grpc.StatusCode.INVALID_ARGUMENT, details
  # An environment we cannot run is refused at Prepare, naming what we do.
  docker = beam_runner_api_pb2.Pipeline()
  docker.components.environments['env'].urn = 'beam:env:docker:v1'
  code, details = _code(lambda: stub.Prepare(
      beam_job_api_pb2.PrepareJobRequest(job_name='docker', pipeline=docker)))
  assert code == grpc.StatusCode.INVALID_ARGUMENT
  assert 'docker' in details and EMBEDDED in details
  # The server still serves.
  stub.GetJobs(beam_job_api_pb2.GetJobsRequest())


def _portable_options(server, *extra):
  from apache_beam.options.pipeline_options import PipelineOptions
  return PipelineOptions([
      '--runner=PortableRunner', f'--job_endpoint={server.endpoint}',
      f'--environment_type={EMBEDDED}'] + list(extra))


def _wait_state(stub, job_id, wanted, timeout=120):
  deadline = time.monotonic() + timeout
  state = None
  while time.monotonic() < deadline:
    state = stub.GetState(
        beam_job_api_pb2.GetJobStateRequest(job_id=job_id)).state
    if state in wanted:
      return state
    time.sleep(0.2)
  return state


def test_cancel_running_job_ends_cancelled(server):
  import apache_beam as beam
  JobState = beam_job_api_pb2.JobState

  def slow(x):
    import time as t
    t.sleep(120)
    return x

  p = beam.Pipeline(options=_portable_options(server))
  _ = p | beam.Create([1, 2, 3, 4]) | beam.Map(slow)
  result = p.run()
  job_id = result._job_id
  assert _wait_state(server.stub, job_id, {JobState.RUNNING}) == JobState.RUNNING
  time.sleep(3)  # let Spark tasks start
  started = time.monotonic()
  server.stub.Cancel(beam_job_api_pb2.CancelJobRequest(job_id=job_id))
  assert _wait_state(
      server.stub, job_id, {JobState.CANCELLED, JobState.FAILED,
                            JobState.DONE}, 60) == JobState.CANCELLED
  assert time.monotonic() - started < 60
  states = [e.state for e in server.stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id=job_id))]
  assert states[-2:] == [JobState.CANCELLING, JobState.CANCELLED]


def test_ten_concurrent_jobs_are_all_correct(server, tmp_path):
  import threading
  import apache_beam as beam

  errors = []

  def submit(i):
    try:
      out = str(tmp_path / f'job{i}' / 'out')
      p = beam.Pipeline(options=_portable_options(server))
      _ = (p | beam.Create(list(range(50 * (i + 1))))
           | beam.Map(lambda x, k=i: x * k) | beam.combiners.Count.Globally()
           | beam.io.WriteToText(out))
      p.run().wait_until_finish()
    except Exception as exn:  # pylint: disable=broad-except
      errors.append((i, exn))

  threads = [threading.Thread(target=submit, args=(i, )) for i in range(10)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(600)
  assert not errors
  for i in range(10):
    assert _read(str(tmp_path / f'job{i}' / 'out')) == [str(50 * (i + 1))]


def test_history_survives_restart(tmp_path):
  import apache_beam as beam
  JobState = beam_job_api_pb2.JobState
  first = Server(tmp_path / 'server')
  try:
    p = beam.Pipeline(options=_portable_options(first, '--job_name=keepme'))
    _ = p | beam.Create([1, 2]) | beam.Map(lambda x: x + 1)
    result = p.run()
    result.wait_until_finish()
    job_id = result._job_id
  finally:
    first.stop()
  second = Server(tmp_path / 'server')
  try:
    jobs = {j.job_id: j for j in second.stub.GetJobs(
        beam_job_api_pb2.GetJobsRequest()).job_info}
    assert jobs[job_id].state == JobState.DONE
    assert jobs[job_id].job_name == 'keepme'
    states = [e.state for e in second.stub.GetStateStream(
        beam_job_api_pb2.GetJobStateRequest(job_id=job_id))]
    assert states[0] == JobState.STOPPED and states[-1] == JobState.DONE
    assert JobState.RUNNING in states
  finally:
    second.stop()


def _messages(stub, job_id):
  """The job's message stream, which ends when the job has ended."""
  out = []
  for response in stub.GetMessageStream(
      beam_job_api_pb2.JobMessagesRequest(job_id=job_id)):
    if response.HasField('message_response'):
      out.append(response.message_response)
  return out


def test_user_log_lines_reach_the_message_stream(server):
  import apache_beam as beam
  Importance = beam_job_api_pb2.JobMessage.MessageImportance

  def chatty(x):
    import logging
    logging.getLogger('my.dofn').info('info line for %s', x)
    logging.getLogger('my.dofn').warning('warning line for %s', x)
    logging.getLogger('my.dofn').debug('debug line for %s', x)
    return x

  p = beam.Pipeline(options=_portable_options(server))
  _ = p | beam.Create(['x1', 'x2']) | beam.Map(chatty)
  result = p.run()
  result.wait_until_finish()
  messages = _messages(server.stub, result._job_id)
  by_text = {m.message_text: m.importance for m in messages}
  for x in ('x1', 'x2'):
    assert by_text.get(f'my.dofn: info line for {x}') == (
        Importance.JOB_MESSAGE_BASIC), sorted(by_text)
    assert by_text.get(f'my.dofn: warning line for {x}') == (
        Importance.JOB_MESSAGE_WARNING)
    # Below Beam's default harness log level (INFO): not forwarded.
    assert f'my.dofn: debug line for {x}' not in by_text


def test_harness_log_level_option_filters_and_bad_level_is_refused(server):
  import apache_beam as beam

  def chatty(x):
    import logging
    logging.getLogger('my.dofn').info('quiet info %s', x)
    logging.getLogger('my.dofn').error('loud error %s', x)
    return x

  p = beam.Pipeline(options=_portable_options(
      server, '--default_sdk_harness_log_level=ERROR'))
  _ = p | beam.Create(['y']) | beam.Map(chatty)
  result = p.run()
  result.wait_until_finish()
  texts = [m.message_text for m in _messages(server.stub, result._job_id)]
  assert '[ERROR] my.dofn: loud error y' in texts
  assert not [t for t in texts if 'quiet info y' in t]

  p = beam.Pipeline(options=_portable_options(
      server, '--default_sdk_harness_log_level=LOUDEST'))
  _ = p | beam.Create(['z']) | beam.Map(chatty)
  with pytest.raises(Exception) as info:
    p.run()
  assert 'LOUDEST' in str(info.value)
  assert 'level name' in str(info.value)


def test_process_harness_logs_reach_the_message_stream(server):
  """PROCESS: the harness's log entries, over the Fn API logging plane."""
  import apache_beam as beam
  from apache_beam.options.pipeline_options import PipelineOptions
  Importance = beam_job_api_pb2.JobMessage.MessageImportance

  def chatty(x):
    import logging
    logging.getLogger('my.process.dofn').error('process harness says %s', x)
    return x

  options = PipelineOptions([
      '--runner=PortableRunner', f'--job_endpoint={server.endpoint}',
      '--environment_type=PROCESS',
      '--environment_config={"command": "%s -m '
      'apache_beam.runners.worker.sdk_worker_main"}' % sys.executable])
  p = beam.Pipeline(options=options)
  _ = p | beam.Create(['p1']) | beam.Map(chatty)
  result = p.run()
  result.wait_until_finish()
  messages = _messages(server.stub, result._job_id)
  hits = [m for m in messages if 'process harness says p1' in m.message_text]
  assert hits, [m.message_text for m in messages]
  # With their level, but as warnings: ERROR is the job's failure alone
  # (Java's client reports the first ERROR message as the job's error).
  assert all(m.importance == Importance.JOB_MESSAGE_WARNING and
             m.message_text.startswith('[ERROR] ') for m in hits)
  assert not [m for m in messages
              if m.importance == Importance.JOB_MESSAGE_ERROR]


def test_job_longer_than_job_server_timeout_ends_done(server):
  """Beam's client opens its state and message streams on the preparation
  id with ``timeout=job_server_timeout``, and on the job id without one
  only if the server refuses the preparation id: ours must, or the client's
  deadline ends every job that runs longer (DEADLINE_EXCEEDED)."""
  import apache_beam as beam

  def slow(x):
    import time as t
    t.sleep(12)
    return x

  p = beam.Pipeline(options=_portable_options(
      server, '--job_server_timeout=5'))
  _ = p | beam.Create([1]) | beam.Map(slow)
  result = p.run()
  assert result.wait_until_finish() == 'DONE'


def test_url_artifacts_are_refused_by_default(server):
  """The job server would fetch them itself, from its network: a server-
  side request forgery, unless its operator lists where they may come
  from (test_artifact_lifecycle.py runs them where allowed)."""
  from jobserver_process import pipeline_with_dependencies
  from jobserver_process import url_dependency
  urls = ['http://169.254.169.254/latest/meta-data/', 'file:///etc/passwd',
          '/etc/shadow']
  code, details = _code(lambda: server.stub.Prepare(
      beam_job_api_pb2.PrepareJobRequest(
          job_name='ssrf', pipeline=pipeline_with_dependencies(
              [url_dependency(u) for u in urls]))))
  assert code == grpc.StatusCode.PERMISSION_DENIED
  for url in urls:
    assert repr(url) in details, details
  assert '--artifact-url-allowlist' in details


def _raw_pipeline(build):
  """A pipeline proto built by ``build(p)``, its transforms' environment
  the embedded one."""
  import apache_beam as beam
  from apache_beam.transforms import environments
  p = beam.Pipeline()
  build(p)
  return p.to_runner_api(
      default_environment=environments.EmbeddedPythonEnvironment.default())


def _run_raw(stub, pipeline, name):
  job_id = stub.Prepare(beam_job_api_pb2.PrepareJobRequest(
      pipeline=pipeline, job_name=name), timeout=120).preparation_id
  stub.Run(beam_job_api_pb2.RunJobRequest(preparation_id=job_id), timeout=120)
  states = [e.state for e in stub.GetStateStream(
      beam_job_api_pb2.GetJobStateRequest(job_id=job_id), timeout=600)]
  return job_id, states[-1]


@pytest.mark.parametrize('distinct', [False, True],
                         ids=['identical', 'distinct'])
def test_150_pardos_each_in_its_own_environment(server, tmp_path, distinct):
  """Beam's Python SDK merges identical environments, other SDKs and
  expansion services may not: 150 ParDos, each in its own copy of one
  environment, were 150 stages that Spark chained into one task function
  its pickler refused ("excessively deep recursion required"). Identical
  copies are merged (planning.normalize); copies that differ (here in a
  capability) stay 150 stages, whose chain of task functions is cut."""
  import apache_beam as beam
  out = str(tmp_path / 'out')

  def build(p):
    pc = p | beam.Create([1, 2, 3])
    for i in range(150):
      pc = pc | f'add{i}' >> beam.Map(lambda x: x + 1)
    _ = pc | beam.Map(str) | beam.io.WriteToText(out)

  pipeline = _raw_pipeline(build)
  envs = pipeline.components.environments
  (base, ) = set(t.environment_id for t in
                 pipeline.components.transforms.values() if t.environment_id)
  for transform_id, transform in pipeline.components.transforms.items():
    if transform.environment_id:
      env = envs[f'own-{transform_id}']
      env.CopyFrom(envs[base])
      if distinct:
        env.capabilities.append(f'beam:test:capability:{transform_id}')
      transform.environment_id = f'own-{transform_id}'
  assert len(envs) > 150
  job_id, state = _run_raw(server.stub, pipeline, f'many-envs-{distinct}')
  assert state == beam_job_api_pb2.JobState.DONE, [
      m.message_text for m in _messages(server.stub, job_id)][-5:]
  assert _read(out) == ['151', '152', '153']


def test_a_refusal_naming_20000_environments_is_cut_to_size(server):
  """Its details travel in gRPC trailers: 7 MB of them, and the client saw
  only that its metadata limit was exceeded, not why."""
  import apache_beam as beam
  pipeline = _raw_pipeline(
      lambda p: p | beam.Create([1]) | beam.Map(str))
  for i in range(20000):
    pipeline.components.environments[f'unused-{i}'].urn = (
        'beam:env:docker:v1')
  code, details = _code(lambda: server.stub.Prepare(
      beam_job_api_pb2.PrepareJobRequest(pipeline=pipeline, job_name='big'),
      timeout=120))
  assert code == grpc.StatusCode.INVALID_ARGUMENT, details
  assert details.startswith('This pipeline cannot run on beam-pyspark')
  assert 'docker' in details
  assert len(details.encode('utf-8')) <= 4096
  assert details.endswith('the rest was cut]')
