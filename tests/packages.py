"""Python packages built by tests, for staging: a wheel, an sdist, a setup.py
project. Not a test module. Written directly (a wheel is a zip file with its
metadata), so tests build them fast and need no build tool nor index.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import zipfile


def module_source(version: str) -> str:
  return f'VERSION = {version!r}\n'


def _digest(data: bytes) -> str:
  return 'sha256=' + base64.urlsafe_b64encode(
      hashlib.sha256(data).digest()).rstrip(b'=').decode()


def write_wheel(
    directory, name: str, version: str, source: str,
    requires: tuple[str, ...] = ()) -> str:
  """A pure-Python wheel whose one package is named like the project."""
  dist_info = f'{name}-{version}.dist-info'
  metadata = f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n'
  metadata += ''.join(f'Requires-Dist: {r}\n' for r in requires)
  files = {
      f'{name}/__init__.py': source.encode(),
      f'{dist_info}/METADATA': metadata.encode(),
      f'{dist_info}/WHEEL': (
          b'Wheel-Version: 1.0\nGenerator: beam-pyspark-tests\n'
          b'Root-Is-Purelib: true\nTag: py3-none-any\n'),
  }
  record = ''.join(f'{p},{_digest(d)},{len(d)}\n' for p, d in files.items())
  path = os.path.join(str(directory), f'{name}-{version}-py3-none-any.whl')
  # A fixed time in every entry: the same wheel written in another second
  # (another process under load) must be the same bytes, so the same
  # staged dependency (test_concurrent_installs_on_one_host_install_once
  # saw two installs when the processes' wheels differed in their times).
  with zipfile.ZipFile(path, 'w') as z:
    for p, d in files.items():
      z.writestr(zipfile.ZipInfo(p, date_time=_FIXED_TIME), d)
    z.writestr(zipfile.ZipInfo(f'{dist_info}/RECORD', date_time=_FIXED_TIME),
               record + f'{dist_info}/RECORD,,\n')
  return path


_FIXED_TIME = (2020, 1, 1, 0, 0, 0)


def _setup_py(name: str, version: str) -> str:
  return ('import setuptools\n'
          f'setuptools.setup(name={name!r}, version={version!r}, '
          f'packages=[{name!r}])\n')


def write_sdist(directory, name: str, version: str, source: str) -> str:
  """An sdist of a setup.py project: whoever installs it must build it."""
  base = f'{name}-{version}'
  files = {
      f'{base}/setup.py': _setup_py(name, version),
      f'{base}/PKG-INFO':
      f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n',
      f'{base}/{name}/__init__.py': source,
  }
  path = os.path.join(str(directory), f'{base}.tar.gz')
  with tarfile.open(path, 'w:gz') as tar:
    for p, text in files.items():
      data = text.encode()
      info = tarfile.TarInfo(p)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return path


def write_project(directory, name: str, version: str, source: str) -> str:
  """A setup.py project (for --setup_file); returns the setup.py path."""
  os.makedirs(os.path.join(str(directory), name))
  with open(os.path.join(str(directory), name, '__init__.py'), 'w') as f:
    f.write(source)
  path = os.path.join(str(directory), 'setup.py')
  with open(path, 'w') as f:
    f.write(_setup_py(name, version))
  return path
