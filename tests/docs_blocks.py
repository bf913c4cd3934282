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
import hashlib
import html
import pathlib
import re

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
  name = path.relative_to(ROOT).as_posix()
  source = path.read_text(encoding='utf-8')
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


def commands(text: str) -> list[str]:
  """A shell block's commands: each line joined with its backslash
  continuations, comments (a whole line, or after ' #') dropped."""
  out, pending = [], ''
  for raw in text.split('\n'):
    line = raw.strip()
    if not pending and (not line or line.startswith('#')):
      continue
    line = re.sub(r'\s+#\s.*$', '', line)
    if line.endswith('\\'):
      pending += line[:-1].rstrip() + ' '
      continue
    out.append(pending + line)
    pending = ''
  if pending:
    out.append(pending.rstrip())
  return out
