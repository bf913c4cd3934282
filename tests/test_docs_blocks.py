"""Every code block of the README and the docs is accounted for (issue 43).

Each block (tests/docs_blocks.py: what MkDocs' Markdown renders as code)
is, by its page and first line, exactly one of:

- RUN: run by the named test, which reads the block from the page with
  ``docs_blocks.block(page, first_line)`` (checked here in the test's
  source), so that editing the page changes what runs;
- RUN_BY_ITS_OWN_READER: run by an older test that reads the page its own
  way (a section's fenced blocks, a marker in the block); checked here:
  its module names the page and the marker, and the marker is the block's
  section heading or in its text;
- NOT_HERE: a command this machine cannot run (a cluster manager, Docker,
  a remote host, minutes of benchmark), with the reason;
- NOT_A_COMMAND: output, a layout, options or a command line shown for
  reading, with what it is.

The last two carry the block's digest: a block edited since it was
declared must be looked at again (it may have become a command). A new
block in none of them fails, saying what to do. Reading files only: well
under a second.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re

import docs_blocks
from docs_blocks import ROOT

TESTS = ROOT / 'tests'
RUN_LOCAL = 'tests/test_docs_blocks_run.py::'
RUN_CLUSTER = 'tests/test_docs_blocks_cluster.py::'
RUN_YARN = 'tests/test_yarn.py::'
HERE = 'tests/test_docs_blocks.py::'

RUN = {
    # The README's, and the home page's copy of them.
    ('README.md', 'import apache_beam as beam'):
        RUN_LOCAL + 'test_the_dataframe_example_runs_as_written',
    ('docs/index.md', 'import apache_beam as beam'):
        RUN_LOCAL + 'test_the_dataframe_example_runs_as_written',
    ('docs/guide/running.md', 'import apache_beam as beam'):
        RUN_LOCAL + 'test_the_dataframe_example_runs_as_written',
    ('README.md', 'beam-pyspark job-server --job-host localhost '
     '--job-port 8099 \\'): 'tests/test_docs_blocks_run.py::readme_server',
    ('docs/index.md', 'beam-pyspark job-server --job-host localhost '
     '--job-port 8099 \\'): 'tests/test_docs_blocks_run.py::readme_server',
    ('README.md', 'python -m apache_beam.examples.wordcount \\'):
        RUN_LOCAL + 'test_the_readmes_job_server_runs_its_wordcount',
    ('docs/index.md', 'python -m apache_beam.examples.wordcount \\'):
        RUN_LOCAL + 'test_the_readmes_job_server_runs_its_wordcount',
    ('docs/sdks/typescript.md', "beam-pyspark job-server --job-port 8099 "
     "--spark-master-url 'local[2]'"):
        RUN_LOCAL + 'test_the_sdk_pages_job_server_line_starts',
    ('docs/sdks/typescript.md', 'const beam = require("apache-beam");'):
        RUN_LOCAL + 'test_the_typescript_pages_program_runs_on_the_readmes_'
        'server',
    ('docs/local-services.md', '$ beam-pyspark local s3'):
        RUN_LOCAL + 'test_the_local_s3_transcript_is_what_it_prints',
    ('docs/guide/running.md', 'beam-pyspark job-server                 '
     '# Job API on localhost:8099,'):
        RUN_LOCAL + 'test_the_running_pages_client_on_the_readmes_server',
    # Running on a cluster, standalone.
    ('docs/guide/clusters.md', "SPARK_HOME=$(python -c 'from pyspark."
     "find_spark_home import _find_spark_home as f; print(f())')"):
        'tests/test_docs_blocks_cluster.py::cluster',
    ('docs/guide/clusters.md', 'python -m apache_beam.examples.wordcount \\'):
        RUN_CLUSTER + 'test_the_runner_on_the_standalone_cluster',
    ('docs/guide/clusters.md',
     'beam-pyspark job-server --job-host $(hostname -f) \\'):
        RUN_CLUSTER + 'test_the_job_server_starts_and_serves_the_cluster_'
        'pages_client',
    ('docs/operations/job-server.md', 'beam-pyspark job-server \\'):
        RUN_CLUSTER + 'test_the_job_server_starts_and_serves_the_cluster_'
        'pages_client',
    # Running on a cluster, YARN (Hadoop's MiniYARNCluster).
    ('docs/guide/clusters.md', 'export HADOOP_CONF_DIR=/etc/hadoop/conf'):
        RUN_YARN + 'test_wordcount_in_client_mode_writes_what_the_direct_'
        'runner_writes',
    ('docs/guide/clusters.md', 'python -m apache_beam.examples.wordcount '
     '--runner=beam_pyspark.PySparkRunner \\'):
        RUN_YARN + 'test_wordcount_in_client_mode_writes_what_the_direct_'
        'runner_writes',
    ('docs/guide/clusters.md',
     'beam-pyspark job-server --spark-master-url yarn \\'):
        RUN_YARN + 'job_server',
    ('docs/guide/clusters.md',
     'spark-submit --master yarn --deploy-mode cluster \\'):
        RUN_YARN + 'test_cluster_mode_runs_the_pipeline_program_in_the_'
        'application_master',
    # Copies of blocks that run.
    ('docs/guide/other-sdks.md',
     './wordcount --input in.txt --output counts.txt \\'):
        HERE + 'test_copies_are_the_blocks_that_run',
}

RUN_BY_ITS_OWN_READER = {
    ('docs/sdks/go.md', 'go mod init example.com/wordcount'):
        ('tests/test_sdk_go.py::test_wordcount_built_and_run_as_the_go_doc_'
         'says', '## Submitting'),
    ('docs/sdks/go.md', "beam-pyspark job-server --job-port 8099 "
     "--spark-master-url 'local[2]'"):
        ('tests/test_sdk_go.py::test_wordcount_built_and_run_as_the_go_doc_'
         'says', '## Submitting'),
    ('docs/sdks/java.md', '<?xml version="1.0" encoding="UTF-8"?>'):
        ('tests/test_sdk_examples.py::test_java_windowed_wordcount_as_the_'
         'java_doc_says', "## A classpath for Beam's examples"),
    ('docs/sdks/java.md',
     'mvn -q dependency:build-classpath -Dmdep.outputFile=classpath.txt'):
        ('tests/test_sdk_examples.py::test_java_windowed_wordcount_as_the_'
         'java_doc_says', "## A classpath for Beam's examples"),
    ('docs/guide/streaming.md', 'import apache_beam as beam'):
        ('tests/test_streaming_docs.py::test_the_guides_self_checkpointing_'
         'read_runs_over_micro_batches', 'class PollTwoAtATime'),
}

_PLACEHOLDER_PROGRAM = ('my_pipeline.py stands for the reader\'s program; '
                        'the same form runs in the README\'s and the cluster '
                        'page\'s blocks (tests/test_docs_blocks_run.py, '
                        'test_docs_blocks_cluster.py)')
_INSTALL = ('installs into the current Python environment: the suite runs '
            'in that install (scripts/setup-venv.sh), which pip must not '
            'change under it')
_BENCH = ('a benchmark run of minutes by design; '
          'tests/test_benchmarks_smoke.py runs the same workloads at a tiny '
          'size')
_EXPANSION = ('resolves the expansion services\' jars with Maven (make '
              'sdk-xlang) and serves until Ctrl-C on fixed ports; '
              'tests/test_local_services.py starts `beam-pyspark local '
              'expansion-services` on free ports and calls both services')
_SERVICE = ('a service on its fixed default ports until Ctrl-C, shown with '
            'the line it prints; tests/test_local_services.py and the '
            'modules it names start the same command on free ports and use '
            'what the line says to paste')

NOT_HERE = {
    ('README.md', "make demo   # Beam's own apache_beam.examples.wordcount "
     "on local Spark"): ('6c5313c136',
                         '`make test` is this suite (a test cannot run the '
                         'suite it is part of); `make demo` builds the venv '
                         'first (make setup), which the suite runs in'),
    ('docs/index.md', "make demo   # Beam's own apache_beam.examples."
     "wordcount on local Spark"): ('6c5313c136', 'the README\'s, above'),
    ('README.md', 'git clone <this repository> beam-pyspark'):
        ('7ca3152323', _INSTALL),
    ('docs/index.md', 'git clone <this repository> beam-pyspark'):
        ('7ca3152323', _INSTALL),
    ('docs/guide/running.md', 'git clone <this repository> beam-pyspark'):
        ('7ca3152323', _INSTALL),
    ('docs/spark-connect.md', "pip install 'beam-pyspark[connect]'"):
        ('d8e895ed37', _INSTALL),
    ('docs/spark-connect.md', "pip install 'pyspark-client==4.2.*' "
     "'apache-beam==2.77.*' sortedcontainers"): (
         '0dcad812ce', _INSTALL + '; and a client-only environment is '
         'another Python environment than the suite\'s'),
    ('README.md', 'python my_pipeline.py --runner=beam_pyspark.PySparkRunner'):
        ('4e66529b03', _PLACEHOLDER_PROGRAM),
    ('docs/index.md',
     'python my_pipeline.py --runner=beam_pyspark.PySparkRunner'):
        ('4e66529b03', _PLACEHOLDER_PROGRAM),
    ('docs/guide/running.md',
     'python my_pipeline.py --runner=beam_pyspark.PySparkRunner'):
        ('4e66529b03', _PLACEHOLDER_PROGRAM),
    # Benchmarks (docs/benchmarks.md).
    ('docs/benchmarks.md', 'make bench      # 5 workloads x 4 ways x 3 runs '
     'over 10 MiB each: a few minutes'): ('7f913be467', _BENCH),
    ('docs/benchmarks.md', '.venv/bin/python -m benchmarks.loadtests '
     '--scale 0.25 --repeats 3'): ('de0e991cea', _BENCH),
    ('docs/benchmarks.md', 'pip install py-spy'): (
        '8fd20939de', 'installs py-spy (' + _INSTALL + ') and profiles a '
        'benchmark of minutes; py-spy also needs ptrace'),
    ('docs/benchmarks.md', '.venv/bin/python -m benchmarks.large_key '
     '--hot-gib 6 --shards 96'): (
         '31af19e623', '6 GiB of one key: tens of minutes and more disk '
         'than CI has; tests/test_grouping.py covers the large-key path at '
         'test sizes'),
    ('docs/benchmarks.md', '.venv/bin/python -m benchmarks.streaming '
     '--rates 100,1000,5000 --seconds 40'): ('ccf40b0777', _BENCH),
    ('docs/benchmarks.md', 'make bench-flink    # PyFlink in .venv-flink '
     '(PyPI apache-flink 2.3), once'): (
         '97d3474d2c', 'installs PyFlink into a venv of its own from PyPI '
         '(~850 MB) and runs minutes of streaming at up to 800k records/s; '
         'tests/test_benchmarks_smoke.py runs the PySpark peers and ours'),
    ('docs/benchmarks.md', '.venv/bin/python -m benchmarks.streaming_profile '
     '--rate 400000 \\'): ('7a706ac87b', _BENCH),
    # Clusters this machine cannot have.
    ('docs/guide/clusters.md', 'venv-pack -o beam-pyspark-env.tar.gz   '
     '# in a venv with this project and venv-pack'): (
        '1684f1d89f', 'YARN with the environment shipped as an archive: '
        'venv-pack is not installed here (' + _INSTALL + '), and packing '
        'the suite\'s 1.4 GB venv took 38 s into 741 MB that each '
        'application uploads to HDFS and each container unpacks: too much '
        'of CI\'s budget. tests/test_yarn.py runs the section\'s other '
        'commands'),
    ('docs/guide/clusters.md', '# Dockerfile'): (
        'c069a7a432', 'Kubernetes images: docker build and a registry; '
        'this machine has no Docker daemon'),
    ('docs/guide/clusters.md',
     'beam-pyspark job-server --job-host $(hostname -i) \\'): (
         '359d0a3d34', 'Kubernetes: a cluster with a service account and '
         'the image above; no Kubernetes or Docker here'),
    ('docs/guide/status-page.md',
     'ssh -L 8090:localhost:8090 -L 4040:localhost:4040 JOBSERVER'): (
         '67907187c8', 'an SSH tunnel to a remote job server host'),
    # Services until Ctrl-C.
    ('docs/guide/kafka.md', 'make expansion-services    # Beam SQL at '
     'localhost:8093, KafkaIO at localhost:8094'): ('8393584a22', _EXPANSION),
    ('docs/guide/sql.md', 'make expansion-services    # Beam SQL at '
     'localhost:8093, KafkaIO at localhost:8094'): ('8393584a22', _EXPANSION),
    ('docs/multi-language.md', 'make expansion-services    # resolves the '
     'jars (make sdk-xlang), then:'): ('385818032b', _EXPANSION),
    ('docs/multi-language.md', 'scripts/expansion-service.sh sql|kafka PORT'):
        ('c125a2b8c2', 'a usage line (sql|kafka, PORT); the script serves '
         'until Ctrl-C: ' + _EXPANSION),
    ('docs/local-services.md', '$ beam-pyspark local kafka --topic events:3'):
        ('e3a8bcd8b5', _SERVICE + ' (tests/test_xlang_kafka.py)'),
    ('docs/local-services.md', '$ beam-pyspark local expansion-services'):
        ('84334084e4', _SERVICE),
    ('docs/local-services.md', '$ beam-pyspark local hdfs'):
        ('6a5d51e057', _SERVICE + ' (tests/test_checkpoint_hdfs.py)'),
    ('docs/local-services.md',
     'java -cp "$(cat sdks/xlang/broker/target/classpath.txt)" \\'): (
         'cff0c474a8', 'Kafka\'s console consumer, reading until Ctrl-C, '
         'against the broker of `beam-pyspark local kafka` above'),
    ('docs/local-services.md', '.venv/bin/python examples/streaming_counts.py '
     '--output /tmp/counts \\'): None,  # two blocks: see _BY_DIGEST
    # Streaming of its stated length.
    ('docs/guide/streaming.md', '.venv/bin/python examples/streaming_counts.py '
     '--output /tmp/counts \\'): (
         '3988ac1052', 'two minutes of streaming (--seconds 120), by design; '
         'tests/test_streaming_live.py runs the same program and flags for '
         'as long as it takes to see a window, then Ctrl-C'),
    # Long suites and templates of other SDKs.
    ('docs/sdks/go.md', 'make sdk-go'): (
        '702c532fd9', 'Beam\'s Go ValidatesRunner primitives: minutes; '
        'tests/test_sdk_go_integration.py runs the same binary and flags'),
    ('docs/sdks/java.md', 'make sdk-java'): (
        '4e9c628365', 'a Java ValidatesRunner suite under Maven: '
        'tests/test_sdk_java_validates_runner.py runs it (about half an '
        'hour of CI)'),
    ('docs/sdks/java.md', 'beam-pyspark job-server --job-port 8099 ...'): (
        'b8bbdead44', 'a template (`...`, <your pipeline\'s classpath>); '
        'the page\'s recipe below, with a real classpath, runs in '
        'tests/test_sdk_examples.py'),
    ('docs/guide/other-sdks.md', "java -cp <the pipeline's classpath> "
     "org.apache.beam.examples.WordCount \\"): (
         '58e3d2be3b', 'a template (<the pipeline\'s classpath>); '
         'docs/sdks/java.md\'s recipe with a real one runs in '
         'tests/test_sdk_examples.py'),
    ('docs/sdks/typescript.md', 'make sdk-typescript            '
     '# npm ci in sdks/typescript'): (
         'd35bea46cc', 'not run as written yet: '
         'tests/test_sdk_typescript.py runs pipelines/wordcount.js with '
         'these flags from its own command line'),
    ('docs/sdks/typescript.md',
     'const { ProcessRunner, DockerRunner } = require("./lib/runner");'): (
         'a74683c8d6', 'a fragment (`pipeline` is the reader\'s) of '
         'tests/test_sdk_typescript.py\'s own runner module (lib/runner), '
         'whose PROCESS and DOCKER runs that test makes'),
    ('docs/multi-language.md',
     'from apache_beam.transforms.sql import SqlTransform'): (
         '06c591dea1', 'a fragment (rows, p, kvs are the reader\'s) against '
         'expansion services on fixed ports; tests/test_xlang_sql.py and '
         'tests/test_xlang_kafka.py run these calls in whole pipelines'),
    ('docs/spark-connect.md', "SPARK_HOME=$(python -c 'import os, pyspark; "
     "print(os.path.dirname(pyspark.__file__))')"): (
         'e088d182ee', 'not run in the suite: a Connect server JVM and a '
         'job through it, about a minute of CI, beside '
         'tests/test_connect.py\'s server of the same class (spark-submit, '
         'a free port) running wordcount through --spark_remote. Run as '
         'written by hand for issue 43 (port appended, SPARK_LOG_DIR and '
         'SPARK_PID_DIR in a temporary directory): its relative --input '
         'failed (read in the server\'s directory), the absolute one gives '
         'the DirectRunner\'s counts'),
    ('docs/version-skew.md', 'python -m beam_pyspark.boot.python 2.61.0 '
     '2.66.0 [--root DIR]'): (
         'b2b24ece36', 'a usage line ([--root DIR]); it pip-installs two '
         'older Beams from PyPI (make sdk-python-versions does, for '
         'tests/test_version_skew.py)'),
}

# Blocks of one page with the same first line, by digest.
_BY_DIGEST = {
    'afe46a5b77': 'HDFS checkpoints, 30 s of streaming against `beam-pyspark '
                  'local hdfs`: tests/test_checkpoint_hdfs.py runs the '
                  'program with those options',
    '1357a533a2': 'S3 checkpoints, 30 s of streaming against `beam-pyspark '
                  'local s3`: tests/test_local_services.py::test_s3_keeps_'
                  'checkpoints_with_the_options_it_prints uses its options',
}

NOT_A_COMMAND = {
    ('README.md', '--runner=beam_pyspark.PySparkRunner'):
        ('c570cc9d2b', 'the flag, named in the first paragraph'),
    ('docs/index.md', '--runner=beam_pyspark.PySparkRunner'):
        ('c570cc9d2b', 'the flag, named in the first paragraph'),
    ('docs/guide/environments.md', 'IMAGE_GLOB=process:COMMAND      '
     'a PROCESS environment with this command'):
        ('afaf784aa2', 'the syntax of an override, a table as text'),
    ('docs/multi-language.md',
     'java -cp <sdks/xlang/NAME/target/classpath.txt> \\'):
        ('1627d84109', 'what scripts/expansion-service.sh runs, shown'),
    ('docs/sdks/java.md', '--defaultEnvironmentType=PROCESS'):
        ('732dc44b55', 'two options of a Java pipeline\'s command line'),
    ('docs/sdks/java.md',
     'java -XX:+UseParallelGC -XX:-OmitStackTraceInFastThrow \\'):
        ('2ebe53a348', 'the command the Java boot runs, shown'),
    ('docs/sdks/java.md', 'org.apache.beam:beam-sdks-java-harness:2.62.0'):
        ('1a2e9f0b2d', 'Maven coordinates'),
    ('docs/sdks/java.md', '"command": "python -m beam_pyspark.boot java '
     '--harness_classpath=/opt/beam/harness/*"'):
        ('b2800c909c', 'a line of an environment\'s JSON config'),
    ('docs/sdks/typescript.md', 'python -m beam_pyspark.boot typescript'):
        ('c4b13d909b', 'the PROCESS command an environment names'),
    ('docs/sdks/typescript.md', 'node <apache-beam>/dist/src/apache_beam/'
     'worker/worker_main.js \\'):
        ('932e1c5181', 'the command the TypeScript boot runs, shown'),
    ('docs/version-skew.md', '$BEAM_PYSPARK_PYTHON_HARNESSES     '
     '(default ~/.cache/beam-pyspark/harness)'):
        ('7f394c5681', 'a directory layout'),
}


def _where(b: docs_blocks.Block) -> str:
  return f'{b.page}:{b.line} (first line {b.first_line!r}, digest {b.digest})'


def _what_to_do() -> str:
  return (
      'Add the block to tests/test_docs_blocks.py: in RUN, naming a test '
      'that reads it with docs_blocks.block(page, first_line) and runs it '
      '(tests/test_docs_blocks_run.py and test_docs_blocks_cluster.py hold '
      'the docs\' runs; reuse their servers and cluster); or in NOT_HERE, '
      'with its digest and why this machine cannot run it; or in '
      'NOT_A_COMMAND, with its digest and what it shows.')


def test_every_block_is_run_or_declared():
  blocks = docs_blocks.blocks()
  assert len(blocks) >= 70, len(blocks)
  keys = collections.Counter((b.page, b.first_line) for b in blocks)
  problems = []
  for b in blocks:
    key = (b.page, b.first_line)
    declared = [name for name, table in (
        ('RUN', RUN), ('RUN_BY_ITS_OWN_READER', RUN_BY_ITS_OWN_READER),
        ('NOT_HERE', NOT_HERE), ('NOT_A_COMMAND', NOT_A_COMMAND))
                if key in table]
    if not declared:
      problems.append(f'{_where(b)}: neither run nor declared. '
                      + _what_to_do())
    elif len(declared) > 1:
      problems.append(f'{_where(b)}: in {declared}: one only')
    elif keys[key] > 1 and (declared != ['NOT_HERE'] or NOT_HERE[key]):
      problems.append(f'{_where(b)}: {keys[key]} blocks of the page start '
                      'so: a test cannot name one by its first line; change '
                      'one, or declare them by digest (_BY_DIGEST)')
    elif declared[0] in ('NOT_HERE', 'NOT_A_COMMAND'):
      entry = (NOT_HERE | NOT_A_COMMAND)[key]
      if entry is None:
        if b.digest not in _BY_DIGEST:
          problems.append(f'{_where(b)}: not in _BY_DIGEST. '
                          + _what_to_do())
      elif entry[0] != b.digest:
        problems.append(
            f'{_where(b)}: declared {declared[0]} for digest {entry[0]}, '
            f'and the block has changed since. Look at it again: if it '
            f'still cannot run here (or is still not a command), set its '
            f'digest to {b.digest!r}; if it can now, run it (RUN).')
  stale = [key for table in (RUN, RUN_BY_ITS_OWN_READER, NOT_HERE,
                             NOT_A_COMMAND) for key in table
           if key not in keys]
  stale += [d for d in _BY_DIGEST if d not in {b.digest for b in blocks}]
  problems += [f'{key}: declared in tests/test_docs_blocks.py but no block '
               f'of the page starts so any more: remove or update the entry'
               for key in stale]
  assert not problems, '\n'.join(problems)


def _page_args(call: ast.Call, scope: ast.AST) -> list[str]:
  """The pages a block() call reads: a literal, or a name that a
  comprehension (or for loop) in its function takes from a literal
  tuple."""
  arg = call.args[0]
  if isinstance(arg, ast.Constant):
    return [arg.value]
  if isinstance(arg, ast.Name):
    for node in ast.walk(scope):
      if isinstance(node, (ast.comprehension, ast.For)) and isinstance(
          node.target, ast.Name) and node.target.id == arg.id:
        return list(ast.literal_eval(node.iter))
  return []


def _literal(arg: ast.expr, scope: ast.AST):
  """A literal, or a name assigned one literal in its function."""
  if isinstance(arg, ast.Name):
    values = [n.value for n in ast.walk(scope) if isinstance(n, ast.Assign)
              and [getattr(t, 'id', None) for t in n.targets] == [arg.id]]
    if len(values) == 1:
      arg = values[0]
  return ast.literal_eval(arg)


def _block_reads(module: pathlib.Path) -> dict[str, set]:
  """(page, first_line) pairs each top-level function of the module reads
  with docs_blocks.block(), by function name."""
  tree = ast.parse(module.read_text(encoding='utf-8'))
  found: dict[str, set] = {}
  for fn in tree.body:
    if not isinstance(fn, ast.FunctionDef):
      continue
    for node in ast.walk(fn):
      if isinstance(node, ast.Call) and (
          getattr(node.func, 'id', None) == 'block' or
          getattr(node.func, 'attr', None) == 'block') and len(node.args) == 2:
        first = _literal(node.args[1], fn)
        for page in _page_args(node, fn):
          found.setdefault(fn.name, set()).add((page, first))
  return found


def _fixtures_of(module: pathlib.Path, name: str) -> set[str]:
  tree = ast.parse(module.read_text(encoding='utf-8'))
  for fn in tree.body:
    if isinstance(fn, ast.FunctionDef) and fn.name == name:
      return {a.arg for a in fn.args.args}
  return set()


def test_each_run_block_is_read_by_its_test():
  """A RUN entry's test (or a fixture it takes) reads the block with
  docs_blocks.block()."""
  problems = []
  for (page, first), target in RUN.items():
    path, _, name = target.partition('::')
    module = ROOT / path
    if not module.is_file():
      problems.append(f'{page} {first!r}: no {path}')
      continue
    reads = _block_reads(module)
    functions = {name} | (_fixtures_of(module, name) & set(reads))
    if not any((page, first) in reads.get(f, ()) for f in functions):
      problems.append(
          f'{page} {first!r}: {target} does not read it with '
          f'block({page!r}, {first!r})')
  assert not problems, '\n'.join(problems)


def _section(page: str, line: int) -> str:
  """The heading (its line, as written) above a line of a page."""
  heading = ''
  for text in (ROOT / page).read_text(encoding='utf-8').split('\n')[:line]:
    if re.match(r'^#{1,6} ', text):
      heading = text.strip()
  return heading


def test_blocks_run_by_their_own_readers_are_where_those_read():
  by_key = {(b.page, b.first_line): b for b in docs_blocks.blocks()}
  problems = []
  for key, (target, marker) in RUN_BY_ITS_OWN_READER.items():
    path, _, name = target.partition('::')
    source = (ROOT / path).read_text(encoding='utf-8')
    b = by_key.get(key)
    if b is None:
      continue  # reported by test_every_block_is_run_or_declared
    if f'def {name}(' not in source:
      problems.append(f'{key}: no test {name} in {path}')
    if pathlib.PurePath(key[0]).name not in source or marker not in source:
      problems.append(f'{key}: {path} names neither the page nor {marker!r}')
    if marker != _section(b.page, b.line) and marker not in b.text:
      problems.append(f'{_where(b)}: {target} reads what {marker!r} '
                      f'marks, which this block no longer is')
  assert not problems, '\n'.join(problems)


def test_copies_are_the_blocks_that_run():
  """The Other SDKs page's Go command is the Go page's, which
  tests/test_sdk_go.py runs as written."""
  copy = docs_blocks.block('docs/guide/other-sdks.md',
                           './wordcount --input in.txt --output counts.txt \\')
  run = docs_blocks.block('docs/sdks/go.md', "beam-pyspark job-server "
                          "--job-port 8099 --spark-master-url 'local[2]'")
  assert copy in run, (copy, run)


def test_the_block_finder_reads_what_markdown_shows():
  """Fenced and indented blocks are blocks, their HTML unescaped; text
  indented six spaces under a list item is prose to MkDocs' Markdown, not
  a block (docs/sdks/java.md's PROCESS options were shown as a paragraph
  so until issue 43)."""
  text = ('# T\n\nProse.\n\n    code <&>\n\n- item:\n\n      --six\n\n'
          'Prose.\n\n```sh\nfenced\n```\n')
  found = docs_blocks.blocks_of_text('docs/x.md', text)
  assert [(b.line, b.kind, b.text) for b in found] == [
      (5, 'code', 'code <&>\n'), (14, 'fenced sh', 'fenced\n')], found
