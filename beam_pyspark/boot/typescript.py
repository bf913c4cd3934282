"""Boot for Beam's TypeScript SDK harness (npm ``apache-beam``).

    python -m beam_pyspark.boot typescript [--node_modules=DIR] [boot flags]

Does what Beam's TypeScript container does (``sdks/typescript/container/
boot.go``), without the container: it starts ``worker_main.js`` of the
``apache-beam`` package with node, passing ``--id``, ``--control_endpoint``,
``--logging_endpoint``, ``--semi_persist_dir``, ``--options`` (the job's
pipeline options as JSON; the worker ``require``s the modules listed in
``beam:option:registered_node_modules:v1``) and ``--status_endpoint``.

The pipeline's own code reaches the worker inside the pipeline: every
function and DoFn the pipeline applies is serialized into its transform's
payload (serialize-closures), so the worker needs only ``apache-beam`` and
the modules the pipeline registered with ``requireForSerialization``. Where
they come from, first match wins:

1. The environment's staged npm artifacts, as the container installs them:
   ``beam:artifact:type:npm_dep:v1`` tarballs become ``overrides`` of a
   ``package.json`` (the role payload names the package), then each
   ``beam:artifact:type:npm:v1`` tarball is ``npm install``-ed, once per
   host and set of packages (in the boot's cache directory). This needs
   npm, and the packages' dependencies in npm's cache or its registry, on
   the executor.
2. An installed ``node_modules`` directory holding ``apache-beam``:
   ``--node_modules=DIR`` after the SDK name in the environment's command,
   else the environment variable ``BEAM_TYPESCRIPT_NODE_MODULES`` (a
   PROCESS environment's ``env`` sets it on the executor), else
   ``./node_modules``. Modules the pipeline registered resolve from there
   too (node looks in the ``node_modules`` directories above
   ``worker_main.js``), so the pipeline's package must be installed in it
   if it registered its own modules.

``node`` is the one on the PATH, or the one ``BEAM_TYPESCRIPT_NODE`` names.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

from beam_pyspark.boot import common

_LOGGER = logging.getLogger('beam_pyspark.boot')

NPM = 'beam:artifact:type:npm:v1'
NPM_DEP = 'beam:artifact:type:npm_dep:v1'
ENV_NODE_MODULES = 'BEAM_TYPESCRIPT_NODE_MODULES'
ENV_NODE = 'BEAM_TYPESCRIPT_NODE'
WORKER_MAIN = os.path.join(
    'apache-beam', 'dist', 'src', 'apache_beam', 'worker', 'worker_main.js')


def main(ctx: common.BootContext) -> None:
  node = os.environ.get(ENV_NODE) or shutil.which('node')
  if not node:
    raise common.BootError(
        'node is not on the PATH of this executor (or set '
        f'{ENV_NODE}): the TypeScript harness is a node program.')
  node_modules = (install_staged_packages(ctx)
                  or installed_node_modules(ctx.extra))
  worker_main = os.path.join(node_modules, WORKER_MAIN)
  if not os.path.isfile(worker_main):
    raise common.BootError(
        f'{node_modules} has no apache-beam ({worker_main} is missing): '
        'install the pipeline\'s package there (npm ci) or stage it.')
  args = worker_args(ctx)
  ids = [ctx.worker_id, *ctx.info.sibling_worker_ids]
  if len(ids) == 1:
    common.exec_harness([node, worker_main, *args, f'--id={ids[0]}'])
  # Sibling workers (the TypeScript environment lists
  # beam:protocol:sibling_workers:v1): one node process each, as the
  # container starts them; the first to end ends the boot.
  procs = [subprocess.Popen([node, worker_main, *args, f'--id={i}'])
           for i in ids]
  try:
    while True:
      for proc in procs:
        try:
          rc = proc.wait(1)
        except subprocess.TimeoutExpired:
          continue
        sys.exit(rc)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.terminate()


def worker_args(ctx: common.BootContext) -> list[str]:
  """worker_main.js's flags (Beam's container passes the same)."""
  args = [
      f'--logging_endpoint={ctx.logging_endpoint}',
      f'--control_endpoint={ctx.control_endpoint}',
      f'--semi_persist_dir={ctx.semi_persist_dir}',
      f'--options={ctx.options_json()}',
  ]
  if ctx.info.status_endpoint.url:
    args.append(f'--status_endpoint={ctx.info.status_endpoint.url}')
  return args


def installed_node_modules(extra: list[str]) -> str:
  """Where apache-beam is installed when nothing was staged."""
  for i, arg in enumerate(extra):
    if arg.startswith('--node_modules='):
      return os.path.abspath(arg.split('=', 1)[1])
    if arg == '--node_modules' and i + 1 < len(extra):
      return os.path.abspath(extra[i + 1])
  return os.path.abspath(
      os.environ.get(ENV_NODE_MODULES) or 'node_modules')


def install_staged_packages(ctx: common.BootContext) -> str | None:
  """Installs the environment's staged npm packages as Beam's container
  does; returns their node_modules, or None when none were staged.

  Installed once per host and set of packages (a directory of the boot's
  cache named by the packages' digests, made under a lock): every worker of
  every job with the same packages uses it (npm install takes ~15 s).
  """
  packages = ctx.with_role(NPM)
  if not packages:
    return None
  deps = ctx.with_role(NPM_DEP)
  digest = hashlib.sha256()
  for artifact in deps + packages:
    digest.update(artifact.role_urn.encode() + b'\0' +
                  artifact.info.role_payload + b'\0')
    with open(artifact.path, 'rb') as f:
      digest.update(hashlib.sha256(f.read()).digest())
  workdir = os.path.join(common.cache_dir(),
                         'typescript-npm-' + digest.hexdigest()[:32])
  node_modules = os.path.join(workdir, 'node_modules')
  done_marker = os.path.join(workdir, '.installed')
  os.makedirs(common.cache_dir(), exist_ok=True)
  with open(workdir + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.path.exists(done_marker):
      _LOGGER.info('Staged npm packages already installed in %s', workdir)
      return node_modules
    tmp = f'{workdir}.tmp-{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _npm_install(tmp, packages, deps)
    shutil.rmtree(workdir, ignore_errors=True)
    os.rename(tmp, workdir)
    with open(done_marker, 'w'):
      pass
  return node_modules


def _npm_install(workdir: str, packages: list[common.RetrievedArtifact],
                 deps: list[common.RetrievedArtifact]) -> None:
  npm = shutil.which('npm')
  if not npm:
    raise common.BootError(
        f'The environment staged {len(packages)} npm package(s), and npm is '
        'not on the PATH of this executor to install them.')
  # npm_dep tarballs: the packages of these names come from them, wherever
  # they are depended on (the role payload names the package).
  overrides = {dep.info.role_payload.decode('utf-8'):
               'file:' + _as_tarball(dep.path) for dep in deps}
  with open(os.path.join(workdir, 'package.json'), 'w') as f:
    json.dump({'name': 'beam-worker', 'version': '1.0.0',
               'overrides': overrides}, f, indent=2)
  for package in packages:
    tarball = _as_tarball(package.path)
    _LOGGER.info('Installing the staged npm package %s in %s', package.name,
                 workdir)
    done = subprocess.run(
        [npm, 'install', '--no-audit', '--no-fund', '--prefer-offline',
         tarball], cwd=workdir, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, check=False)
    if done.returncode != 0:
      raise common.BootError(
          f'npm install {package.name} failed ({done.returncode}):\n'
          f'{done.stdout[-4000:]}')


def _as_tarball(path: str) -> str:
  if path.endswith(('.tgz', '.tar', '.tar.gz')):
    return path
  target = path + '.tgz'
  if not os.path.exists(target):
    try:
      os.link(path, target)
    except OSError:
      shutil.copy(path, target)
  return target
