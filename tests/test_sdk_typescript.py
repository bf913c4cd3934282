"""Beam's TypeScript SDK (npm apache-beam 2.49.0) on the job server.

The pipelines of ``sdks/typescript`` (WordCount, a side input, windowed
grouping with the window in context) are submitted by the SDK's own
PortableRunner, in LOOPBACK (the SDK's worker pool in the submitting node
process) and in PROCESS (``python -m beam_pyspark.boot typescript`` starts
the SDK's ``worker_main.js`` on the executor), and their output must equal
the same pipeline's on Beam's own Python job service (FnApiRunner), which
runs TypeScript pipelines, and what the test computes from the input.

``make sdk-typescript`` (a step of ``make test``) installs the package
(``npm ci``) the tests run from.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from jobserver_process import JobServerProcess

TS_DIR = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'sdks', 'typescript')
PIPELINE_TIMEOUT = 240
# The PROCESS environment's command, as a user writes it: the runner appends
# the boot flags, and puts its own interpreter's directory first on the
# command's PATH (so `python` is the executor's Python, with beam_pyspark).
BOOT_COMMAND = 'python -m beam_pyspark.boot typescript'

WORDS = ('the quick brown fox jumps over the lazy dog and the cat sat on '
         'the mat while a dog barked at the moon over the hills of Spark '
         "and Beam's portable runners").split()
STOPWORDS = ['the', 'a', 'and', 'of', 'over']


def _node() -> str:
  node = shutil.which('node')
  assert node, 'node is not on the PATH: the TypeScript SDK needs Node 18+'
  return node


@pytest.fixture(scope='module')
def sdk():
  """The installed package (make sdk-typescript)."""
  worker = os.path.join(TS_DIR, 'node_modules', 'apache-beam', 'dist', 'src',
                        'apache_beam', 'worker', 'worker_main.js')
  assert os.path.isfile(worker), (
      f'{worker} is missing: run `make sdk-typescript` (npm ci in '
      f'{TS_DIR}), which `make test` does first')
  return _node()


@pytest.fixture(scope='module')
def inputs(tmp_path_factory):
  d = tmp_path_factory.mktemp('ts-inputs')
  text = d / 'text.txt'
  # Some lines repeat, one is empty, words carry punctuation.
  lines = [' '.join(WORDS[i:i + 7]) + ('.' if i % 2 else ',')
           for i in range(0, len(WORDS), 5)]
  text.write_text('\n'.join(lines + ['', lines[0], lines[3]]) + '\n')
  stop = d / 'stopwords.txt'
  stop.write_text('\n'.join(STOPWORDS) + '\n')
  events = d / 'events.txt'
  # "seconds word": on window edges (9.999, 10, 20), out of order.
  timed = [(1, 'cat'), (2, 'dog'), (3, 'cat'), (12, 'cat'), (15, 'dog'),
           (19.5, 'dog'), (25, 'cat'), (9.999, 'bird'), (10, 'bird'),
           (20, 'bird'), (0, 'dog'), (31, 'cat'), (7, 'cat')]
  events.write_text(''.join(f'{t} {w}\n' for t, w in timed))
  return {'text': str(text), 'stopwords': str(stop), 'events': str(events),
          'timed': timed}


def _words(path):
  with open(path, encoding='utf-8') as f:
    return [w for line in f for w in re.split(r"[^A-Za-z']+", line) if w]


def expected_wordcount(inputs):
  return sorted(f'{w}: {n}' for w, n in
                collections.Counter(_words(inputs['text'])).items())


def expected_side_input(inputs):
  words = _words(inputs['text'])
  mean = sum(map(len, words)) / len(words)
  return sorted(f'{w} {len(w)} {"long" if len(w) > mean else "short"}'
                for w in words if w not in STOPWORDS)


def expected_windowed(inputs):
  groups = collections.defaultdict(list)
  for seconds, word in inputs['timed']:
    start = math.floor(seconds / 10) * 10
    groups[(start, word)].append(seconds)
  return sorted(
      f'[{start}, {start + 10}) {word} {len(ts)} '
      + ','.join(f'{t:g}' for t in sorted(ts))
      for (start, word), ts in groups.items())


def expected_sessions(inputs, gap=5):
  """Sessions per word: [t, t + gap) windows merged where they overlap."""
  by_word = collections.defaultdict(list)
  for seconds, word in inputs['timed']:
    by_word[word].append(seconds)
  lines = []
  for word, times in by_word.items():
    session = []
    for t in sorted(times) + [None]:
      if session and (t is None or t >= session[-1] + gap):
        lines.append(f'[{session[0]:g}, {session[-1] + gap:g}) {word} '
                     f'{len(session)} ' + ','.join(f'{x:g}' for x in session))
        session = []
      if t is not None:
        session.append(t)
  return sorted(lines)


PIPELINES = {
    'wordcount': (lambda i: ['--input', i['text']], expected_wordcount),
    'side_input': (lambda i: ['--input', i['text'],
                              '--stopwords', i['stopwords']],
                   expected_side_input),
    'windowed': (lambda i: ['--input', i['events']], expected_windowed),
    # Merging windows: the runner merges sessions with Python's Sessions
    # (the TypeScript SDK uses its standard URN and the interval window
    # coder). LOOPBACK only: the harness is the same as for 'windowed'.
    'sessions': (lambda i: ['--input', i['events'],
                            '--sessions_gap_secs', '5'], expected_sessions),
}
SCRIPTS = {'sessions': 'windowed'}


def run_pipeline(name, inputs, out_dir, job_endpoint, *env_flags):
  """Runs ``sdks/typescript/pipelines/<name>.js``; its output lines, sorted
  (each bundle writes its own file: the order is not the pipeline's)."""
  node = _node()
  flags, _ = PIPELINES[name]
  prefix = os.path.join(str(out_dir), name)
  started = time.monotonic()
  done = subprocess.run(
      [node, os.path.join('pipelines', f'{SCRIPTS.get(name, name)}.js'),
       f'--job_endpoint={job_endpoint}', f'--output={prefix}',
       *flags(inputs), *env_flags],
      cwd=TS_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, timeout=PIPELINE_TIMEOUT, check=False)
  took = time.monotonic() - started
  assert done.returncode == 0, (
      f'{name} ({" ".join(env_flags)}) failed ({done.returncode}) after '
      f'{took:.0f}s:\n{done.stdout[-6000:]}')
  assert 'Pipeline DONE' in done.stdout
  return _output(prefix), done.stdout


def counters(client_out):
  """The job's user counters as the SDK's PipelineResult reads them from
  the job service's metrics (lib/runner.js prints them)."""
  [line] = re.findall(r'^Counters: (.*)$', client_out, re.M)
  return json.loads(line)


def _output(prefix):
  lines = []
  for path in glob.glob(prefix + '-*'):
    with open(path, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  return sorted(lines)


@pytest.fixture(scope='module')
def reference_service(sdk, tmp_path_factory):
  """Beam's Python job service (FnApiRunner): the reference."""
  d = tmp_path_factory.mktemp('beam-job-service')
  port_file = d / 'port'
  log = open(d / 'log', 'wb')
  proc = subprocess.Popen(
      [sys.executable, '-m',
       'apache_beam.runners.portability.local_job_service_main',
       '--port', '0', '--port_file', str(port_file)],
      stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 60
    while not port_file.exists():
      assert proc.poll() is None, (d / 'log').read_text()
      assert time.monotonic() < deadline, 'Beam\'s job service did not start'
      time.sleep(0.1)
    yield f'localhost:{port_file.read_text().strip()}'
  finally:
    proc.terminate()
    proc.wait(30)
    log.close()


@dataclasses.dataclass
class Reference:
  outputs: dict  # pipeline -> its sorted output lines
  counters: dict  # pipeline -> its user counters


@pytest.fixture(scope='module')
def reference(reference_service, inputs, tmp_path_factory):
  """Each pipeline's output on Beam's job service (LOOPBACK: Beam's
  FnApiRunner has no PROCESS environments other than Python's)."""
  out = tmp_path_factory.mktemp('ts-reference')
  runs = {name: run_pipeline(name, inputs, out, reference_service)
          for name in PIPELINES}
  return Reference(
      outputs={name: lines for name, (lines, _) in runs.items()},
      counters={name: counters(out) for name, (_, out) in runs.items()})


@pytest.fixture(scope='module')
def boot_cache(tmp_path_factory):
  """The boot's per-host cache (staged npm packages are installed there):
  the test's own, so the staged-packages test really installs them."""
  return tmp_path_factory.mktemp('ts-boot-cache')


@pytest.fixture(scope='module')
def server(sdk, tmp_path_factory, boot_cache):
  s = JobServerProcess(tmp_path_factory.mktemp('ts-jobserver') / 'artifacts',
                       env={'BEAM_PYSPARK_BOOT_CACHE': str(boot_cache)})
  yield s
  s.stop()


def test_reference_runs_are_what_the_input_says(reference, inputs):
  """Beam's job service runs the pipelines to what the input implies, so
  equal output on ours means right output."""
  with open(inputs['text'], encoding='utf-8') as f:
    lines = [line for line in f.read().splitlines() if line]
  assert reference.counters['wordcount'] == {
      'lines': len(lines), 'words': len(_words(inputs['text']))}
  for name, (_, expected) in PIPELINES.items():
    assert reference.outputs[name] == expected(inputs), name
  # Not trivially equal: each pipeline did real work.
  assert len(reference.outputs['wordcount']) > 20
  assert any(line.endswith(' long') for line in reference.outputs['side_input'])
  assert '[10, 20) bird 1 10' in reference.outputs['windowed']
  assert '[9.999, 15) bird 2 9.999,10' in reference.outputs['sessions']


ENVIRONMENTS = {
    'LOOPBACK': ('--environment_type=LOOPBACK',),
    'PROCESS': ('--environment_type=PROCESS',
                f'--environment_config={BOOT_COMMAND}'),
}


# The TypeScript harness logs each control request it gets (apache-beam
# 2.49.0's Worker.handleRequest), and worker_main.js its start.
BUNDLE_REQUEST = re.compile(r"oneofKind: 'processBundle'")
WORKER_MAIN_STARTED = re.compile(r'^Starting worker \S+', re.M)


def _log_since(server, offset):
  with open(server.log_path, 'rb') as f:
    f.seek(offset)
    return f.read().decode('utf-8', 'replace')


@pytest.mark.parametrize('name,environment', [
    (name, environment) for name in PIPELINES for environment in ENVIRONMENTS
    if (name, environment) != ('sessions', 'PROCESS')])
def test_pipeline_output_equals_beams_job_service(
    name, environment, server, reference, inputs, tmp_path):
  offset = os.path.getsize(server.log_path)
  got, client_out = run_pipeline(name, inputs, tmp_path, server.job_endpoint,
                                 *ENVIRONMENTS[environment])
  server_log = _log_since(server, offset)
  assert got == reference.outputs[name], (
      f'{name} in {environment}: output differs from Beam\'s job service; '
      f'job server log:\n{server_log[-6000:]}')
  # The TypeScript harness's metrics, aggregated by the runner over every
  # bundle, as Beam's job service reports them.
  assert counters(client_out) == reference.counters[name]
  # Where the harness ran: in the submitting node program (LOOPBACK), or
  # started by the executor through the boot (PROCESS).
  if environment == 'LOOPBACK':
    assert BUNDLE_REQUEST.search(client_out), client_out[-3000:]
    assert not BUNDLE_REQUEST.search(server_log)
  else:
    assert not BUNDLE_REQUEST.search(client_out)
    assert BUNDLE_REQUEST.search(server_log), server_log[-3000:]
    assert WORKER_MAIN_STARTED.search(server_log), server_log[-3000:]
    # The apache-beam next to the pipeline (BEAM_TYPESCRIPT_NODE_MODULES).
    assert _harness_node_modules(server_log) == {
        os.path.join(TS_DIR, 'node_modules')}, server_log[-3000:]


def _harness_node_modules(server_log):
  """The node_modules directories the boot started worker_main.js from."""
  return set(re.findall(
      r'boot INFO Starting the SDK harness: \S*node (\S+)/apache-beam/dist/'
      r'src/apache_beam/worker/worker_main\.js', server_log))


def test_process_with_staged_npm_packages(
    server, reference, inputs, tmp_path, boot_cache):
  """PROCESS as Beam's TypeScript container runs it: the job stages the
  pipeline's package and apache-beam as npm tarballs (the roles Beam's
  docker environments use), and the boot installs them on the executor
  (once per host: every worker of the job shares the install)."""
  offset = os.path.getsize(server.log_path)
  got, _ = run_pipeline('wordcount', inputs, tmp_path, server.job_endpoint,
                        *ENVIRONMENTS['PROCESS'], '--stage_npm_packages')
  server_log = _log_since(server, offset)
  assert got == reference.outputs['wordcount'], server_log[-6000:]
  installed = re.findall(
      r'boot INFO Installing the staged npm package [0-9a-f]+-(\S+)\.tgz',
      server_log)
  assert installed == ['apache-beam-2.49.0',
                       'beam-pyspark-typescript-pipelines-0.0.0'], (
                           server_log[-6000:])
  [modules] = _harness_node_modules(server_log)
  assert modules.startswith(str(boot_cache) + os.sep), modules


def test_docker_environment_boots_as_beams_container_would(
    server, reference, inputs, tmp_path, boot_cache):
  """The SDK's own non-LOOPBACK environment: Beam's TypeScript image with
  the staged npm packages (less the 2.49.0 client's broken npm pack). The
  job server's default override runs that image as a PROCESS environment
  booted by ``python -m beam_pyspark.boot typescript``."""
  offset = os.path.getsize(server.log_path)
  got, _ = run_pipeline('wordcount', inputs, tmp_path, server.job_endpoint,
                        '--environment_type=DOCKER')
  server_log = _log_since(server, offset)
  assert got == reference.outputs['wordcount'], server_log[-6000:]
  [modules] = _harness_node_modules(server_log)
  assert modules.startswith(str(boot_cache) + os.sep), modules


# -- The boot's choices, without a job ----------------------------------------


def _boot_context(tmp_path, extra=(), artifacts=()):
  from apache_beam.portability.api import beam_provision_api_pb2
  from beam_pyspark.boot import common
  return common.BootContext(
      worker_id='w1', provision_endpoint='p:1', control_endpoint='c:2',
      artifact_endpoint='a:3', logging_endpoint='l:4',
      semi_persist_dir=str(tmp_path),
      info=beam_provision_api_pb2.ProvisionInfo(), artifacts=list(artifacts),
      extra=list(extra))


def test_boot_finds_apache_beam_by_flag_then_environment_then_cwd(
    tmp_path, monkeypatch):
  from beam_pyspark.boot import typescript
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv(typescript.ENV_NODE_MODULES, '/from/env')
  assert typescript.installed_node_modules(
      ['--node_modules=/from/flag']) == '/from/flag'
  assert typescript.installed_node_modules(
      ['--node_modules', '/from/flag2']) == '/from/flag2'
  assert typescript.installed_node_modules([]) == '/from/env'
  monkeypatch.delenv(typescript.ENV_NODE_MODULES)
  assert typescript.installed_node_modules([]) == str(
      tmp_path / 'node_modules')


def test_boot_without_apache_beam_says_where_it_looked(tmp_path, monkeypatch):
  from beam_pyspark.boot import common
  from beam_pyspark.boot import typescript
  monkeypatch.setenv(typescript.ENV_NODE, _node())
  with pytest.raises(common.BootError, match='has no apache-beam') as info:
    typescript.main(_boot_context(
        tmp_path, extra=[f'--node_modules={tmp_path}/nothing']))
  assert f'{tmp_path}/nothing' in str(info.value)


def test_boot_passes_worker_main_the_containers_flags(tmp_path):
  from beam_pyspark.boot import typescript
  ctx = _boot_context(tmp_path)
  ctx.info.pipeline_options.update(
      {'beam:option:registered_node_modules:v1': ['apache-beam']})
  ctx.info.status_endpoint.url = 's:5'
  args = typescript.worker_args(ctx)
  assert args[:3] == ['--logging_endpoint=l:4', '--control_endpoint=c:2',
                      f'--semi_persist_dir={tmp_path}']
  options = json.loads(args[3][len('--options='):])
  assert options == {'beam:option:registered_node_modules:v1': ['apache-beam']}
  assert args[4:] == ['--status_endpoint=s:5']
