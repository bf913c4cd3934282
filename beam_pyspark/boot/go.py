"""Boot for Go's harness: the staged pipeline binary, started with --worker.

    --environment_type=PROCESS
    --environment_config='{"command": "python -m beam_pyspark.boot go"}'

Beam's Go SDK has no separate harness: the pipeline's own binary is the
worker. Go's PortableRunner stages it as the environment's one dependency
(role ``beam:artifact:role:go_worker_binary:v1``; it is the submitting
binary itself, or one cross-compiled for linux/amd64). This does what Beam's
Go container boot (``sdks/go/container/boot.go``) does after provisioning:
find that binary among the retrieved artifacts, make it executable, write
the job's options to a file named by ``PIPELINE_OPTIONS_FILE``, and exec it
with ``--worker=true`` and the endpoints.
"""

from __future__ import annotations

import json
import os
import stat

from google.protobuf import json_format

from beam_pyspark.boot import common

GO_WORKER_ROLE = 'beam:artifact:role:go_worker_binary:v1'
# The name Go's runners staged the binary under before the role existed
# (Beam's boot still accepts it).
LEGACY_NAME = 'worker'


def worker_binary(artifacts: list[common.RetrievedArtifact]) -> str:
  """The Go worker binary's local path, chosen as Beam's Go boot chooses:
  the only artifact, else the one with the Go worker role, else the one
  named ``worker``."""
  if not artifacts:
    raise common.BootError(
        'The environment has no staged artifacts, so there is no Go worker '
        'binary to start. Go\'s PortableRunner stages the pipeline binary '
        'for PROCESS environments; was the job submitted with '
        '--environment_type=PROCESS?')
  if len(artifacts) == 1:
    return artifacts[0].path
  for artifact in artifacts:
    if artifact.role_urn == GO_WORKER_ROLE:
      return artifact.path
  for artifact in artifacts:
    if artifact.name == LEGACY_NAME:
      return artifact.path
  raise common.BootError(
      f'None of the environment\'s {len(artifacts)} artifacts is a Go worker '
      f'binary (role {GO_WORKER_ROLE}, or named {LEGACY_NAME!r}): '
      f'{", ".join(a.name for a in artifacts)}')


def harness_command(ctx: common.BootContext, binary: str) -> list[str]:
  return [
      binary,
      '--worker=true',
      f'--id={ctx.worker_id}',
      f'--logging_endpoint={ctx.logging_endpoint}',
      f'--control_endpoint={ctx.control_endpoint}',
      f'--semi_persist_dir={ctx.semi_persist_dir}',
  ] + ctx.extra


def options_json(ctx: common.BootContext) -> str:
  """The job's options as JSON the Go harness reads.

  A protobuf Struct holds every number as a double; Python writes an
  integral one as ``-1.0``, which Go's encoding/json refuses for an int
  field (``beam:option:parallelism:v1``), where Go's own boot writes ``-1``.
  """
  def integral(value):
    if isinstance(value, float) and value.is_integer():
      return int(value)
    if isinstance(value, dict):
      return {k: integral(v) for k, v in value.items()}
    if isinstance(value, list):
      return [integral(v) for v in value]
    return value

  return json.dumps(
      integral(json_format.MessageToDict(ctx.info.pipeline_options)),
      indent=2)


def harness_env(ctx: common.BootContext, options_file: str) -> dict:
  env = dict(os.environ)
  # The Go harness reads its options from this file (the PIPELINE_OPTIONS
  # variable of Java's and Python's harnesses means nothing to it).
  env['PIPELINE_OPTIONS_FILE'] = options_file
  if ctx.info.status_endpoint.url:
    env['STATUS_ENDPOINT'] = ctx.info.status_endpoint.url
  if ctx.info.runner_capabilities:
    env['RUNNER_CAPABILITIES'] = ' '.join(ctx.info.runner_capabilities)
  return env


def main(ctx: common.BootContext) -> None:
  binary = worker_binary(ctx.artifacts)
  # Retrieved files are not executable (and may be links into the host's
  # cache, which then becomes executable too: the same binary).
  mode = os.stat(binary).st_mode
  os.chmod(binary, mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
  options_file = os.path.join(ctx.semi_persist_dir, 'pipeline_options.json')
  with open(options_file, 'w', encoding='utf-8') as f:
    f.write(options_json(ctx))
  common.exec_harness(harness_command(ctx, binary),
                      harness_env(ctx, options_file))
