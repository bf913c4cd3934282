"""Beam's Go SDK on the job server: Go's wordcount, LOOPBACK and PROCESS.

Go's own wordcount example (`make sdk-go` builds it from Beam's Go SDK,
pinned in sdks/go/go.mod), submitted by Go's portable runner to a real
`beam-pyspark job-server` on local[2], against the same program on Go's
direct runner. PROCESS starts each harness with `python -m
beam_pyspark.boot go`, which fetches the staged pipeline binary over the Fn
API and starts it as Go's worker.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest

import go_sdk
from jobserver_process import JobServerProcess
from beam_pyspark.boot import common
from beam_pyspark.boot import go as go_boot

# Go's wordcount takes words as [a-zA-Z]+('[a-z])?: 'Café' counts 'Caf'.
VOCAB = ['river', 'bridge', 'stone', 'song', 'road', 'map', 'promise', 'mill',
         "miller's", 'Café', 'naïve', 'the', 'a', 'of', 'and']


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  s = JobServerProcess(tmp_path_factory.mktemp('go-js') / 'artifacts')
  yield s
  s.stop()


@pytest.fixture(scope='module')
def text(tmp_path_factory):
  """A few thousand lines: several of Spark's partitions of Go's reads."""
  path = tmp_path_factory.mktemp('go-in') / 'in.txt'
  rng = random.Random(25)
  words = VOCAB + [''.join(rng.choice('abcdefghijklmnopqrstuvwxyzABC')
                           for _ in range(rng.randint(2, 9)))
                   for _ in range(800)]
  with open(path, 'w', encoding='utf-8') as f:
    for _ in range(4000):
      f.write(' '.join(rng.choice(words) for _ in range(rng.randint(1, 12))))
      f.write('\n')
  return str(path)


def _wordcount(args, input_path, output, timeout=300):
  wordcount = go_sdk.program('wordcount')
  # TMPDIR: Go's runner leaves a file there per LOOPBACK job.
  proc = subprocess.run(
      [wordcount, f'--input={input_path}', f'--output={output}', *args],
      capture_output=True, text=True, timeout=timeout, check=False,
      env={**os.environ, 'TMPDIR': os.path.dirname(output)})
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert os.path.exists(output), proc.stderr[-6000:]
  return go_sdk.count_lines([output]), proc.stderr


@pytest.fixture(scope='module')
def expected(text, tmp_path_factory):
  """Go's direct runner, in the test process: what the counts must be."""
  out = str(tmp_path_factory.mktemp('go-direct') / 'counts.txt')
  counts, _ = _wordcount(['--runner=direct'], text, out)
  assert len(counts) > 800 and "miller's" in '\n'.join(counts)
  return counts


GO_DOC = os.path.join(go_sdk.REPO, 'docs', 'sdks', 'go.md')


def _doc_shell_blocks(heading: str) -> list[str]:
  with open(GO_DOC, encoding='utf-8') as f:
    doc = f.read()
  start = doc.index(heading + '\n')
  end = doc.find('\n## ', start + len(heading))
  return re.findall(r'^```sh\n(.*?)^```$', doc[start:end], re.M | re.S)


def test_wordcount_built_and_run_as_the_go_doc_says(
    server, text, expected, tmp_path):
  """docs/sdks/go.md's steps as written (issue 43: its `go build` failed
  outside a module): the build commands in an empty directory, with Go's
  module and build caches `make sdk-go` filled (so only the link runs), then
  its `./wordcount` line against this job server, LOOPBACK: the counts of
  Go's direct runner."""
  build, run = _doc_shell_blocks('## Submitting')
  work = tmp_path / 'doc'
  work.mkdir()
  proc = subprocess.run(
      ['bash', '-euo', 'pipefail', '-c', build], cwd=work,
      capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert os.access(work / 'wordcount', os.X_OK), os.listdir(work)
  # The job server line starts this test's server, which runs already.
  lines = [l for l in run.splitlines()
           if not l.startswith('beam-pyspark job-server')]
  assert 'localhost:8099' in run and lines[0].startswith('./wordcount')
  with open(text, encoding='utf-8') as f:
    (work / 'in.txt').write_text(f.read(), encoding='utf-8')
  proc = subprocess.run(
      ['bash', '-euo', 'pipefail', '-c',
       '\n'.join(lines).replace('localhost:8099', server.job_endpoint)],
      cwd=work, capture_output=True, text=True, timeout=300, check=False,
      # Go's runner leaves a file in TMPDIR per LOOPBACK job.
      env={**os.environ, 'TMPDIR': str(work)})
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert go_sdk.count_lines([str(work / 'counts.txt')]) == expected


def _boot_command() -> str:
  return f'{sys.executable} -m beam_pyspark.boot go'


def test_wordcount_process_boots_the_staged_binary(
    server, text, expected, tmp_path):
  # Go's runner stages no binary of its own accord (it would cross-compile
  # the main package from source): --worker_binary names the program.
  out = str(tmp_path / 'counts.txt')
  config = json.dumps({'command': _boot_command()})
  counts, log = _wordcount(
      go_sdk.portable_args(server.job_endpoint, 'PROCESS', config) +
      [f'--worker_binary={go_sdk.program("wordcount")}'], text, out)
  assert 'state: DONE' in log
  # The job's stages ran in Go harnesses the runner started (not in this
  # process): it names their environment.
  assert "'go' (go, process)" in log
  assert counts == expected


def test_a_go_worker_that_cannot_start_fails_the_job_with_its_words(
    server, text, tmp_path):
  """The staged worker binary says why it cannot run and exits 3: the job
  FAILS with that line first in its error, which Go's client shows, and
  writes nothing (never DONE with fewer records)."""
  worker = tmp_path / 'worker.sh'
  worker.write_text('#!/bin/sh\n'
                    'echo "go worker (test): no pipeline in this binary" >&2\n'
                    'exit 3\n')
  worker.chmod(0o755)
  out = str(tmp_path / 'counts.txt')
  config = json.dumps({'command': _boot_command()})
  proc = subprocess.run(
      [go_sdk.program('wordcount'), f'--input={text}', f'--output={out}',
       *go_sdk.portable_args(server.job_endpoint, 'PROCESS', config),
       f'--worker_binary={worker}'],
      capture_output=True, text=True, timeout=300, check=False,
      env={**os.environ, 'TMPDIR': str(tmp_path)})
  assert proc.returncode != 0, proc.stderr[-6000:]
  assert 'state: FAILED' in proc.stderr, proc.stderr[-6000:]
  failures = [line for line in proc.stderr.splitlines()
                 if 'level=ERROR' in line and 'exited with code 3' in line]
  # (Go's client logs the job's messages with newlines escaped.)
  assert len(failures) == 1, proc.stderr[-6000:]
  first = failures[0].split('\\n')[0]
  assert first.endswith('go worker (test): no pipeline in this binary'), (
      failures[0])
  assert not os.path.exists(out)


# -- the boot's parts, without a runner ----------------------------------------


def _artifact(path, name, role=''):
  from apache_beam.portability.api import beam_runner_api_pb2  # pylint: disable=import-outside-toplevel
  return common.RetrievedArtifact(
      path=path, name=name,
      info=beam_runner_api_pb2.ArtifactInformation(role_urn=role))


def test_the_worker_binary_is_chosen_as_beams_go_boot_chooses():
  only = _artifact('/s/anything', 'anything')
  assert go_boot.worker_binary([only]) == '/s/anything'
  by_role = [_artifact('/s/a.txt', 'a.txt'), _artifact('/s/worker', 'worker'),
             _artifact('/s/bin', 'bin', go_boot.GO_WORKER_ROLE)]
  assert go_boot.worker_binary(by_role) == '/s/bin'
  legacy = [_artifact('/s/a.txt', 'a.txt'), _artifact('/s/worker', 'worker')]
  assert go_boot.worker_binary(legacy) == '/s/worker'
  with pytest.raises(common.BootError, match='PROCESS'):
    go_boot.worker_binary([])
  with pytest.raises(common.BootError, match="'a.txt', 'b'|a.txt, b"):
    go_boot.worker_binary([_artifact('/s/a.txt', 'a.txt'),
                           _artifact('/s/b', 'b')])


def test_options_are_written_as_gos_boot_writes_them():
  from apache_beam.portability.api import beam_provision_api_pb2  # pylint: disable=import-outside-toplevel
  info = beam_provision_api_pb2.ProvisionInfo()
  info.pipeline_options.update({
      'beam:option:parallelism:v1': -1,
      'beam:option:go_options:v1': {'options': {'input': 'x', 'n': 2.5}},
  })
  ctx = common.BootContext(
      worker_id='w', provision_endpoint='p:1', control_endpoint='c:1',
      artifact_endpoint='a:1', logging_endpoint='l:1', semi_persist_dir='/s',
      info=info, artifacts=[], extra=[])
  text = go_boot.options_json(ctx)
  parallelism = json.loads(text)['beam:option:parallelism:v1']
  assert parallelism == -1 and isinstance(parallelism, int)
  assert '-1.0' not in text
  assert json.loads(text)['beam:option:go_options:v1'] == {
      'options': {'input': 'x', 'n': 2.5}}
  assert go_boot.harness_command(ctx, '/s/bin') == [
      '/s/bin', '--worker=true', '--id=w', '--logging_endpoint=l:1',
      '--control_endpoint=c:1', '--semi_persist_dir=/s']


def test_wordcount_in_gos_default_docker_environment(
    server, text, expected, tmp_path):
  # No environment flags: Go's default is a Docker environment of Beam's Go
  # image, which the job server runs as `python -m beam_pyspark.boot go`
  # (its default environment overrides).
  out = str(tmp_path / 'counts.txt')
  counts, log = _wordcount(
      ['--runner=portable', f'--endpoint={server.job_endpoint}',
       f'--worker_binary={go_sdk.program("wordcount")}'], text, out)
  assert "'apache/beam_go_sdk:" in log and 'beam_pyspark.boot go' in log
  assert "'go' (go, process)" in log
  assert counts == expected
