"""``beam-pyspark local ...`` run as a user runs it, for the tests.

Not a test module: tests/test_local_services.py runs each command, and
tests/test_checkpoint_hdfs.py's HDFS is ``beam-pyspark local hdfs``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LocalCommand:
  """``beam-pyspark local ARGS`` running; ``line`` is what it printed."""

  def __init__(self, *args: str, timeout: float = 300):
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'beam_pyspark.cli', 'local', *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    found: list = []
    reader = threading.Thread(
        target=lambda: found.append(self.proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not found or not found[0]:
      self.proc.kill()
      _, err = self.proc.communicate(timeout=60)
      pytest.fail(f'beam-pyspark local {args[0]} printed no line (it ended '
                  f'with {self.proc.returncode}, or {timeout} s passed):\n'
                  f'{err.decode(errors="replace")}')
    self.line = found[0].decode()
    assert self.line.rstrip().endswith('; Ctrl-C stops it'), self.line

  def flags(self) -> list[str]:
    return re.findall(r'(--\w+=\S+)', self.line.replace(';', ' '))

  def interrupt(self) -> None:
    """Ctrl-C: one line saying it stopped, exit 0, no traceback."""
    self.proc.send_signal(signal.SIGINT)
    out, err = self.proc.communicate(timeout=30)
    out, err = out.decode(errors='replace'), err.decode(errors='replace')
    assert self.proc.returncode == 0, (out, err)
    assert 'Traceback' not in err + out, err
    assert re.fullmatch(r'beam-pyspark local \S+: stopped .* \(SIGINT\)\n',
                        out), out

  def pasted(self) -> types.SimpleNamespace:
    """A store's printed location and options, as checkpoint_store_checks
    takes a server: ``url(path)`` under the location, ``options``."""
    flags = self.flags()
    root = next(f.split('=', 1)[1] for f in flags
                if f.startswith('--checkpoint_location='))
    return types.SimpleNamespace(
        url=lambda path: f'{root}/{path.lstrip("/")}',
        options=[f for f in flags
                 if not f.startswith('--checkpoint_location=')])
