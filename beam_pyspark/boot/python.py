"""Boot of Beam's Python SDK harness of another Beam version.

    python -m beam_pyspark.boot python --beam_version=2.61.0

is what a Python environment of another Beam version than the job server's
runs as when the job or the server asks for it (the ``=versioned``
environment override, ``planning.environments``): the embedded harness is
the job server's Beam, which cannot unpickle another version's functions
(2.61's are pickled with dill, which ours does not even install).

The harness is Beam's own ``apache_beam.runners.worker.sdk_worker_main`` of
that version, from a virtualenv of this host's cache made once per version
(``python -m venv`` with this executor's interpreter, then ``pip install
apache-beam==VERSION`` from the package index pip is configured with: the
executors must reach one, or find the virtualenv already there):

    $BEAM_PYSPARK_PYTHON_HARNESSES   (default ~/.cache/beam-pyspark/harness)
      beam-2.61.0-py3.11/            one virtualenv per Beam and Python

A lock file keeps two harnesses of one host from installing at once; a
virtualenv counts only once its install finished (a stamp file in it).

As Beam's container boot does, the job's staged files are retrieved into
``<semi_persist_dir>/staged`` (the harness loads a saved main session from
there); staged Python packages (requirements files, wheels, sdists) are
installed into a directory of this harness's own, on its PYTHONPATH, never
into the shared virtualenv. The runner's own PYTHONPATH (its Beam) is not
passed on.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
from typing import Sequence

from beam_pyspark.boot import common

_LOGGER = logging.getLogger('beam_pyspark.boot.python')

ENV_HARNESSES = 'BEAM_PYSPARK_PYTHON_HARNESSES'
ENV_INSTALL_TIMEOUT = 'BEAM_PYSPARK_PYTHON_HARNESS_INSTALL_TIMEOUT'
STAMP = '.beam-pyspark-installed'
_VERSION = re.compile(r'^\d+\.\d+\.\d+[0-9A-Za-z.+-]*$')
# Staged files Beam's Python boot installs (boot.go): a requirements file,
# the SDK's or the job's packages.
_PACKAGE = re.compile(r'\.(whl|tar\.gz|zip)$')
_REQUIREMENTS = 'requirements.txt'


def parse_extra(extra: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog='python -m beam_pyspark.boot python')
  p.add_argument('--beam_version', required=True)
  flags, _ = p.parse_known_args(list(extra))
  return flags


def harnesses_dir() -> str:
  return os.environ.get(ENV_HARNESSES) or os.path.join(
      os.path.expanduser('~'), '.cache', 'beam-pyspark', 'harness')


def venv_dir(version: str, root: str = '') -> str:
  py = f'{sys.version_info.major}.{sys.version_info.minor}'
  return os.path.abspath(
      os.path.join(root or harnesses_dir(), f'beam-{version}-py{py}'))


def venv_python(venv: str) -> str:
  return os.path.join(venv, 'bin', 'python')


def ensure_venv(version: str, root: str = '') -> str:
  """The virtualenv with apache-beam==version, made if missing; returns
  its directory. Raises BootError saying what pip said."""
  if not _VERSION.match(version):
    raise common.BootError(
        f'{version!r} is not a Beam version (e.g. 2.61.0).')
  venv = venv_dir(version, root)
  if os.path.exists(os.path.join(venv, STAMP)):
    return venv
  os.makedirs(os.path.dirname(venv), exist_ok=True)
  with open(venv + '.lock', 'w', encoding='utf-8') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another harness may be installing
    if os.path.exists(os.path.join(venv, STAMP)):
      return venv
    shutil.rmtree(venv, ignore_errors=True)  # an install that broke off
    _LOGGER.info('Installing apache-beam==%s into %s (once per host)',
                 version, venv)
    # Our own interpreter's base, not a virtualenv's: venv takes it so.
    _run([sys.executable, '-m', 'venv', venv], f'python -m venv {venv}')
    _run([venv_python(venv), '-m', 'pip', 'install', '-q',
          f'apache-beam=={version}'],
         f'pip install apache-beam=={version} (the package index must be '
         f'reachable from this host, or {venv} made beforehand)')
    with open(os.path.join(venv, STAMP), 'w', encoding='utf-8') as f:
      f.write(version + '\n')
  return venv


def _run(argv: list[str], what: str) -> None:
  env = dict(os.environ)
  env.pop('PYTHONPATH', None)  # the runner's Beam must not shadow its own
  timeout = float(os.environ.get(ENV_INSTALL_TIMEOUT) or 1800)
  try:
    done = subprocess.run(argv, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired as exn:
    raise common.BootError(f'{what}: no end after {timeout:.0f} s') from exn
  if done.returncode != 0:
    raise common.BootError(
        f'{what} failed ({done.returncode}): '
        f'{(done.stderr or done.stdout)[-2000:]}')


def install_staged(ctx: common.BootContext, python: str) -> str:
  """Installs the job's staged Python packages into a directory of this
  harness's own (``pip install --target``); returns it, or '' if none."""
  staged = [a for a in ctx.artifacts
            if a.name == _REQUIREMENTS or _PACKAGE.search(a.name)]
  if not staged:
    return ''
  target = os.path.join(ctx.semi_persist_dir, 'site')
  for artifact in staged:
    args = (['-r', artifact.path] if artifact.name == _REQUIREMENTS
            else [artifact.path])
    _run([python, '-m', 'pip', 'install', '-q', '--target', target, *args],
         f'pip install of the staged {artifact.name!r}')
  return target


def command(ctx: common.BootContext) -> tuple[list[str], dict]:
  flags = parse_extra(ctx.extra)
  venv = ensure_venv(flags.beam_version)
  python = venv_python(venv)
  env = dict(os.environ)
  env.pop('PYTHONPATH', None)
  site = install_staged(ctx, python)
  if site:
    env['PYTHONPATH'] = site
  env.update(
      SEMI_PERSISTENT_DIRECTORY=ctx.semi_persist_dir,
      WORKER_ID=ctx.worker_id,
      PIPELINE_OPTIONS=ctx.options_json())
  env.update({k: v for k, v in ctx.fn_api_env().items() if v is not None})
  return [python, '-m', 'apache_beam.runners.worker.sdk_worker_main'], env


def main(ctx: common.BootContext) -> None:
  argv, env = command(ctx)
  _LOGGER.info('Python harness %s: Beam %s from %s', ctx.worker_id,
               parse_extra(ctx.extra).beam_version, argv[0])
  common.exec_harness(argv, env)


def install_main(argv: Sequence[str]) -> int:
  """``python -m beam_pyspark.boot.python VERSION... [--root DIR]``: makes
  the virtualenvs beforehand (an executor's image, a host without the
  package index, the tests' set-up)."""
  logging.basicConfig(level=logging.INFO, format='%(message)s')
  p = argparse.ArgumentParser(prog='python -m beam_pyspark.boot.python')
  p.add_argument('versions', nargs='+')
  p.add_argument('--root', default='', help=f'default: ${ENV_HARNESSES}, '
                 'else ~/.cache/beam-pyspark/harness')
  args = p.parse_args(list(argv))
  for version in args.versions:
    try:
      print(ensure_venv(version, args.root))
    except common.BootError as exn:
      print(f'apache-beam=={version}: {exn}', file=sys.stderr)
      return 1
  return 0


if __name__ == '__main__':
  sys.exit(install_main(sys.argv[1:]))
