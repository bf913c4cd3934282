"""The docs' local commands and programs, run as written.

Each test reads its blocks from the pages (docs_blocks.block), replaces
only what names the reader's machine (docs_blocks.localize) and runs them;
outputs are compared with Beam's DirectRunner's, or pandas'. One job
server, started by the README's command, serves the README's wordcount.
The cluster pages' blocks: tests/test_docs_blocks_cluster.py; which test
runs which block: tests/test_docs_blocks.py.
"""

from __future__ import annotations

import re

import grpc
import pytest
from apache_beam.portability.api import beam_job_api_pb2
from apache_beam.portability.api import beam_job_api_pb2_grpc

from docs_blocks import ROOT
from docs_blocks import SAMPLE
from docs_blocks import ShellServer
from docs_blocks import block
from docs_blocks import counts
from docs_blocks import direct_wordcount
from docs_blocks import free_port
from docs_blocks import localize
from docs_blocks import run_shell
from docs_blocks import shell_env
from local_command import LocalCommand


@pytest.fixture(scope='module')
def direct_counts(tmp_path_factory) -> list[str]:
  return direct_wordcount(str(tmp_path_factory.mktemp('direct') / 'counts'))


# -- the README's (and the home page's) ---------------------------------------


def test_the_dataframe_example_runs_as_written(tmp_path):
  """README, docs/index.md, docs/guide/running.md: the same program; run
  over CSVs of its own, the sums are the sums. In a process of its own, as
  a user runs it: in this one, the Spark it starts on its default master
  would outlive it and serve the next tests' pipelines (the runner keeps a
  running SparkContext)."""
  (text,) = {block(page, 'import apache_beam as beam')
             for page in ('README.md', 'docs/index.md',
                          'docs/guide/running.md')}
  data = tmp_path / 'data'
  data.mkdir()
  for part in range(2):
    with open(data / f'sales{part}.csv', 'w', encoding='utf-8') as f:
      f.write('region,amount\n')
      for i in range(100):
        f.write(f'r{i % 3},{i + part}\n')
  program = localize(text, {"'/data/": f"'{data}/"})
  (tmp_path / 'example.py').write_text(program, encoding='utf-8')
  run_shell('python example.py', tmp_path / 'log', cwd=tmp_path)
  lines = counts(str(data / 'totals'))
  expected = {f'r{r}': sum(i + part for part in range(2) for i in range(100)
                           if i % 3 == r) for r in range(3)}
  rows = dict(l.split(',') for l in lines if not l.startswith('region'))
  assert {k: int(v) for k, v in rows.items()} == expected, lines


@pytest.fixture(scope='module')
def readme_server(tmp_path_factory):
  """The README's job server command, on free ports."""
  (text,) = {block(page, 'beam-pyspark job-server --job-host localhost '
                   '--job-port 8099 \\')
             for page in ('README.md', 'docs/index.md')}
  home = tmp_path_factory.mktemp('readme-server')
  script = localize(text, {
      '8099': str(free_port()), '8098': str(free_port()),
      '8097': str(free_port()), '8090': str(free_port()),
      '~/.beam-pyspark/artifacts': str(home / 'artifacts')})
  server = ShellServer(script, str(home / 'server.log'))
  try:
    yield server
  finally:
    server.stop()


def test_the_readmes_job_server_runs_its_wordcount(
    readme_server, direct_counts, tmp_path):
  (text,) = {block(page, 'python -m apache_beam.examples.wordcount \\')
             for page in ('README.md', 'docs/index.md')}
  script = localize(text, {
      'localhost:8099': readme_server.endpoints['job'],
      '/tmp/counts': str(tmp_path / 'counts')})
  run_shell(script, tmp_path / 'log')
  assert counts(str(tmp_path / 'counts')) == direct_counts


def _job_server_defaults() -> dict:
  import argparse
  from beam_pyspark import cli
  parser = argparse.ArgumentParser()
  cli._job_server_parser(parser.add_subparsers(dest='command'))  # pylint: disable=protected-access
  return vars(parser.parse_args(['job-server']))


def test_the_running_pages_client_on_the_readmes_server(
    readme_server, direct_counts, tmp_path):
  """docs/guide/running.md's job server block: its server line is the
  README's with every flag left at its default (checked against the CLI's
  own parser), so the README's server runs it; its client line, with
  my_pipeline.py Beam's wordcount, runs against that server."""
  text = block('docs/guide/running.md', 'beam-pyspark job-server'
               '                 # Job API on localhost:8099,')
  server_line, client = re.split(r'\n(?=python )', text.strip('\n'))
  assert server_line.split('#')[0].strip() == 'beam-pyspark job-server'
  readme = block('README.md', 'beam-pyspark job-server --job-host localhost '
                 '--job-port 8099 \\')
  words = readme.replace('\\\n', ' ').split()
  flags = dict(zip(words[2::2], words[3::2]))
  defaults = _job_server_defaults()
  for flag, value in flags.items():
    if flag != '--artifacts-dir':  # the CLI's None: this path (the guide)
      assert str(defaults[flag[2:].replace('-', '_')]) == value, flag
  from apache_beam.examples import wordcount
  run_shell(localize(client, {
      'my_pipeline.py': f'{wordcount.__file__} --input {SAMPLE} '
                        f'--output {tmp_path / "counts"}',
      'localhost:8099': readme_server.endpoints['job']}), tmp_path / 'log')
  assert counts(str(tmp_path / 'counts')) == direct_counts


def _done_jobs(endpoint: str) -> int:
  with grpc.insecure_channel(endpoint) as channel:
    jobs = beam_job_api_pb2_grpc.JobServiceStub(channel).GetJobs(
        beam_job_api_pb2.GetJobsRequest(), timeout=30).job_info
  return sum(j.state == beam_job_api_pb2.JobState.DONE for j in jobs)


def test_the_typescript_pages_program_runs_on_the_readmes_server(
    readme_server, tmp_path):
  """docs/sdks/typescript.md's first program (node, the SDK of
  sdks/typescript's lock file, LOOPBACK): it exits 0, its job DONE."""
  node_modules = ROOT / 'sdks' / 'typescript' / 'node_modules'
  assert (node_modules / 'apache-beam').is_dir(), (
      'make sdk-typescript installs the TypeScript SDK this test runs')
  program = localize(block('docs/sdks/typescript.md',
                           'const beam = require("apache-beam");'),
                     {'localhost:8099': readme_server.endpoints['job']})
  (tmp_path / 'pipeline.js').write_text(program, encoding='utf-8')
  before = _done_jobs(readme_server.endpoints['job'])
  run_shell('node pipeline.js', tmp_path / 'log', timeout=300, cwd=tmp_path,
            env=shell_env({'NODE_PATH': str(node_modules)}))
  assert _done_jobs(readme_server.endpoints['job']) == before + 1


def test_the_sdk_pages_job_server_line_starts(tmp_path):
  """The Go and TypeScript pages' one-line job server start (the Go test
  runs its own server in its place): it listens, then stops on SIGTERM."""
  line = "beam-pyspark job-server --job-port 8099 --spark-master-url 'local[2]'"
  (text,) = {block('docs/sdks/typescript.md', line),
             block('docs/sdks/go.md', line).split('\n')[0] + '\n'}
  # The two other ports are the CLI's defaults: free ones instead.
  script = localize(text, {'8099': str(free_port())}).strip() + (
      f' --artifact-port {free_port()} --expansion-port {free_port()}'
      f' --status-port {free_port()} --artifacts-dir {tmp_path / "a"}')
  server = ShellServer(script, str(tmp_path / 'server.log'))
  try:
    assert server.proc.poll() is None, server.log()
  finally:
    server.stop()
  assert server.proc.returncode == 0, server.log()




def test_the_local_s3_transcript_is_what_it_prints():
  """docs/local-services.md's `$ beam-pyspark local s3` and the line it
  shows: the command (on a free port, not 9000) prints that line, and
  stops on Ctrl-C. (The Kafka, HDFS and expansion services' transcripts
  start JVMs: declared in tests/test_docs_blocks.py.)"""
  command, shown = block('docs/local-services.md',
                         '$ beam-pyspark local s3').strip('\n').split('\n')
  args = command.split()[3:]
  port = str(free_port())
  running = LocalCommand(*args, '--port', port)
  try:
    assert running.line.strip() == localize(shown, {'9000': port}), (
        running.line)
  finally:
    running.interrupt()
