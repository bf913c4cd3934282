"""The code blocks of the README and the docs/ pages, as a reader sees them.

Not a test module. ``blocks()`` lists every code block of README.md and
docs/**/*.md, fenced (```) or indented, as Python-Markdown (MkDocs'
renderer) shows it; tests/test_docs_blocks.py checks that each block is
run by a named test, declared not runnable here, or declared not a
command. A test that runs a block reads it with ``block(page, first_line)``
(so that editing the page changes what runs); tests/test_docs_blocks.py
finds those calls in the test modules.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import html
import os
import pathlib
import re
import subprocess
import sys
import time

import psutil

from beam_pyspark.local.processes import free_port  # noqa: F401 (re-exported)

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Block:
  page: str  # relative to the repository, e.g. 'docs/guide/clusters.md'
  line: int  # where the block's text starts, 1-based
  kind: str  # 'code' (indented, or fenced without a language), 'fenced sh'
  text: str  # as rendered: the indent or the fences removed, ending in \n

  @property
  def first_line(self) -> str:
    return self.text.split('\n', 1)[0].strip()

  @property
  def digest(self) -> str:
    return digest(self.text)


def digest(text: str) -> str:
  """Ten hex digits of the block's text, trailing blanks ignored."""
  norm = '\n'.join(l.rstrip() for l in text.strip('\n').split('\n'))
  return hashlib.sha256(norm.encode('utf-8')).hexdigest()[:10]


def pages() -> list[pathlib.Path]:
  return [ROOT / 'README.md'] + sorted((ROOT / 'docs').rglob('*.md'))


def _markdown():
  """Python-Markdown as MkDocs runs it on these pages: its default
  extensions (mkdocs.yml adds none)."""
  import markdown  # mkdocs' own dependency
  return markdown.Markdown(extensions=['toc', 'tables', 'fenced_code'])


def page_blocks(path: pathlib.Path) -> list[Block]:
  """The page's code blocks, in order: what Python-Markdown renders as
  <pre><code> (so text indented in a way it does not read as code, e.g.
  six spaces under a list item, is not a block: it is shown as prose)."""
  return blocks_of_text(path.relative_to(ROOT).as_posix(),
                        path.read_text(encoding='utf-8'))


def blocks_of_text(name: str, source: str) -> list[Block]:
  rendered = _markdown().convert(source)
  lines = source.split('\n')
  found, at = [], 0
  for m in re.finditer(r'<pre><code(?: class="language-([^"]*)")?>(.*?)'
                       r'</code></pre>', rendered, re.S):
    text = html.unescape(m.group(2))
    first = text.split('\n', 1)[0]
    # Where it starts: the next source line that is its first line (a
    # fence's line is the one before).
    while at < len(lines) and lines[at].strip() != first.strip():
      at += 1
    if at == len(lines):
      raise AssertionError(f'{name}: no line reads {first!r}')
    kind = f'fenced {m.group(1)}' if m.group(1) else 'code'
    found.append(Block(name, at + 1, kind, text))
    at += 1
  return found


def blocks() -> list[Block]:
  return [b for p in pages() for b in page_blocks(p)]


def block(page: str, first_line: str) -> str:
  """The text of the one block of ``page`` whose first line is
  ``first_line`` (stripped): what a test runs."""
  found = [b for b in page_blocks(ROOT / page) if b.first_line == first_line]
  if len(found) != 1:
    raise LookupError(
        f'{page} has {len(found)} code blocks whose first line is '
        f'{first_line!r}: the page changed under a test that runs its '
        f'block; update the test (and tests/test_docs_blocks.py) with it')
  return found[0].text


# -- running a block -------------------------------------------------------
# Tests replace only what names the reader's machine (MASTER, JOBSERVER,
# fixed ports that tests running in parallel could hold, /data and /var/lib
# paths), through ``localize``, which fails if a placeholder is gone from
# the block, and run the result with bash, the venv's bin/ first on PATH as
# an activated venv has it.

SAMPLE = str(ROOT / 'examples' / 'data' / 'sample.txt')
_LISTENING = re.compile(r'(Job|Artifact|Expansion) service listening on (.*)$')


def localize(text: str, replacements: dict[str, str]) -> str:
  """The block with the reader's names replaced by this machine's: each
  must be in the block (a page that changed them changes the test too)."""
  for old, new in replacements.items():
    assert old in text, (
        f'{old!r} is no longer in the block:\n{text}\nthe test replaces it '
        f'with {new!r}; update the replacements with the page')
    text = text.replace(old, new)
  return text


def shell_env(extra: dict | None = None) -> dict:
  """An activated venv's environment: its bin/ first (beam-pyspark,
  python)."""
  env = dict(os.environ)
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  env.update(extra or {})
  return env


def run_shell(script: str, log_path, timeout: float = 420, env=None,
              cwd=ROOT) -> str:
  with open(log_path, 'wb') as log:
    proc = subprocess.run(
        ['bash', '-euo', 'pipefail', '-c', script], cwd=cwd, stdout=log,
        stderr=subprocess.STDOUT, timeout=timeout, check=False,
        env=env or shell_env())
  text = open(log_path, encoding='utf-8', errors='replace').read()
  assert proc.returncode == 0, f'{script}\nexited {proc.returncode}:\n' + (
      text[-8000:])
  return text


def counts(prefix: str) -> list[str]:
  lines = []
  for shard in sorted(glob.glob(prefix + '*')):
    with open(shard, encoding='utf-8') as f:
      lines.extend(f.read().splitlines())
  assert lines, f'no output at {prefix}*'
  return sorted(lines)


def direct_wordcount(out: str) -> list[str]:
  """Beam's wordcount of examples/data/sample.txt on the DirectRunner."""
  from apache_beam.examples import wordcount
  wordcount.run([f'--input={SAMPLE}', f'--output={out}',
                 '--runner=DirectRunner'], save_main_session=False)
  return counts(out)


class ShellServer:
  """A job server started by a doc's shell command; its endpoints read
  from its stdout as the CLI prints them."""
  def __init__(self, script: str, log_path: str, env=None, timeout=180):
    self.log_path = log_path
    self._log = open(log_path, 'ab')
    self.proc = subprocess.Popen(
        ['bash', '-c', script], stdout=subprocess.PIPE, stderr=self._log,
        text=True, env=env or shell_env(), start_new_session=True, cwd=ROOT)
    self.endpoints: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    try:
      while len(self.endpoints) < 3 and time.monotonic() < deadline:
        line = self.proc.stdout.readline()
        if not line:
          raise RuntimeError(f'job server exited ({self.proc.wait()}) before '
                             f'listening:\n{self.log()}')
        m = _LISTENING.match(line.strip())
        if m:
          self.endpoints[m.group(1).lower()] = m.group(2)
      assert len(self.endpoints) == 3, self.log()
    except BaseException:
      self.stop()
      raise

  def log(self) -> str:
    with open(self.log_path, encoding='utf-8', errors='replace') as f:
      return f.read()[-6000:]

  def stop(self) -> None:
    try:
      family = [psutil.Process(self.proc.pid)]
      family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
      family = []
    for p in family:  # SIGTERM, as a deployment stops it
      try:
        p.terminate()
      except psutil.NoSuchProcess:
        pass
    _, alive = psutil.wait_procs(family, timeout=60)
    for p in alive:
      p.kill()
    self.proc.wait(30)
    self._log.close()
