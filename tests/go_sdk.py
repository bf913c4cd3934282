"""Beam's Go SDK in tests: its compiled programs and `go test -v` output.

Not a test module. `make sdk-go` builds the programs into sdks/go/bin from
the Go module in sdks/go (Beam's Go SDK from the module proxy, pinned in
its go.mod): Go's wordcount example and the test binaries of Beam's Go
integration test packages (`go test -c`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GO_BIN = os.path.join(REPO, 'sdks', 'go', 'bin')
# The test binaries `make sdk-go` builds, by the package they test.
TEST_PACKAGES = {
    'primitives': 'primitives.test',
    'synthetic': 'synthetic.test',
    'wordcount': 'wordcount.test',
    'regression': 'regression.test',
}


def program(name: str) -> str:
  path = os.path.join(GO_BIN, name)
  if not os.access(path, os.X_OK):
    pytest.fail(
        f'{path} is missing: `make sdk-go` builds Beam\'s Go programs '
        '(`make test` runs it first).')
  return path


def portable_args(endpoint: str, environment_type: str = 'LOOPBACK',
                  environment_config: str | None = None) -> list[str]:
  """Go's flags for Beam's portable runner against ``endpoint``."""
  args = ['--runner=portable', f'--endpoint={endpoint}',
          f'--environment_type={environment_type}']
  if environment_config is not None:
    args.append(f'--environment_config={environment_config}')
  return args


@dataclasses.dataclass
class GoTest:
  """One test (or subtest) of a `go test -v` run."""
  name: str
  status: str = 'RUN'  # PASS, FAIL, SKIP; RUN if it never finished
  seconds: float = 0.0
  output: list[str] = dataclasses.field(default_factory=list)

  @property
  def text(self) -> str:
    return '\n'.join(self.output)


_RUN = re.compile(r'^=== (RUN|CONT|PAUSE|NAME)\s+(\S+)')
_END = re.compile(r'^\s*--- (PASS|FAIL|SKIP): (\S+) \(([\d.]+)s\)')


def parse_verbose(text: str) -> dict[str, GoTest]:
  """The tests of a test binary's `-test.v` output, in the order they ran.

  A test's output lines (its t.Log, t.Skip and t.Error messages, and the
  pipeline's log lines printed while it was the running test) are kept
  with it; a test that started but has no end line stays RUN (the binary
  crashed or timed out there).
  """
  tests: dict[str, GoTest] = {}
  current = None
  for line in text.splitlines():
    m = _RUN.match(line)
    if m:
      current = tests.setdefault(m.group(2), GoTest(m.group(2)))
      continue
    m = _END.match(line)
    if m:
      test = tests.setdefault(m.group(2), GoTest(m.group(2)))
      test.status, test.seconds = m.group(1), float(m.group(3))
      current = test
      continue
    if current is not None:
      current.output.append(line)
  return tests


def list_tests(binary: str) -> list[str]:
  """The top-level tests a test binary has (`-test.list`)."""
  proc = subprocess.run([binary, '-test.list', '.*'], capture_output=True,
                        text=True, timeout=120, check=True)
  return [line for line in proc.stdout.splitlines()
          if re.fullmatch(r'(Test|Example|Benchmark|Fuzz)\w*', line)]


def read_output(path: str) -> str:
  with open(path, encoding='utf-8', errors='replace') as f:
    return f.read()


def count_lines(paths: list[str]) -> list[str]:
  """The lines of text files, sorted (a textio output's content)."""
  lines = []
  for path in paths:
    with open(path, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  return sorted(lines)
