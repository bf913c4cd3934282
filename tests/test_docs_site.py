"""The documentation builds, its links hold and its commands run as written.

The README is the front page (at most 250 lines: what it is, install, the
two commands, a first pipeline each way, links); everything else is the
MkDocs site under docs/ (mkdocs.yml). Here: the site builds with --strict
(MkDocs' own validation makes a broken relative link or #anchor, or a page
left out of the nav, an error); every relative link of the README and the
pages reaches a file, and an #anchor into a page a heading; every page is
in the nav or listed as deliberately not; and the commands the pages show
name flags and options that exist: `beam-pyspark <command> --flag` against
the parser the CLI itself builds, `python ... --runner=beam_pyspark.PySparkRunner` (or
PortableRunner) `--option` against Beam's and this runner's pipeline
options, and the Options page's table against both. A few seconds: one
`mkdocs build` subprocess, the rest is reading files.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / 'docs'
README = ROOT / 'README.md'
README_MAX_LINES = 250


def _pages() -> list[pathlib.Path]:
  return sorted(DOCS.rglob('*.md'))


def _mkdocs_config() -> dict:
  # mkdocs.yml uses no YAML tags of MkDocs' own (!ENV ...), so safe_load
  # reads it.
  return yaml.safe_load((ROOT / 'mkdocs.yml').read_text(encoding='utf-8'))


def _prose(text: str) -> str:
  """The text outside fenced and indented code blocks and inline code."""
  out, fence = [], False
  for line in text.split('\n'):
    if line.startswith('```'):
      fence = not fence
      continue
    if fence or line.startswith('    '):
      continue
    out.append(re.sub(r'`[^`]*`', '', line))
  return '\n'.join(out)


_LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')


def _links(path: pathlib.Path) -> list[str]:
  return _LINK.findall(_prose(path.read_text(encoding='utf-8')))


def _slug(heading: str) -> str:
  """The id Python-Markdown's toc extension (MkDocs' default) gives."""
  from markdown.extensions.toc import slugify  # mkdocs' own dependency
  text = re.sub(r'[`*_]', '', heading)
  text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', text)
  return slugify(text, '-')


def _anchors(path: pathlib.Path) -> set[str]:
  text = path.read_text(encoding='utf-8')
  fence, anchors = False, set()
  for line in text.split('\n'):
    if line.startswith('```'):
      fence = not fence
    m = re.match(r'^#{1,6} (.*?)\s*#*$', line)
    if m and not fence:
      anchors.add(_slug(m.group(1)))
  return anchors


def _build(config: pathlib.Path, site: pathlib.Path):
  if importlib.util.find_spec('mkdocs') is None:
    pytest.fail("mkdocs is not installed: pip install -e '.[test]' (or "
                "'.[docs]') installs the pinned version")
  # Not --quiet: MkDocs 1.6 counts --strict's warnings through its logger,
  # and --quiet drops them before they are counted (the build passes).
  return subprocess.run(
      [sys.executable, '-m', 'mkdocs', 'build', '--strict',
       '--config-file', str(config), '--site-dir', str(site)],
      cwd=config.parent, capture_output=True, text=True, timeout=120,
      check=False)


def test_the_site_builds_strict(tmp_path):
  out = _build(ROOT / 'mkdocs.yml', tmp_path / 'site')
  assert out.returncode == 0, (
      'mkdocs build --strict failed (a broken link or anchor, or a page '
      'missing from the nav of mkdocs.yml):\n' + out.stdout + out.stderr)
  assert (tmp_path / 'site' / 'index.html').is_file()
  assert (tmp_path / 'site' / 'guide' / 'streaming.html').is_file()
  # It reads offline: no script or stylesheet from the internet (the
  # theme's highlight.js CDN is off in mkdocs.yml).
  remote = [f'{page.relative_to(tmp_path)}: {m}'
            for page in (tmp_path / 'site').rglob('*.html')
            for m in re.findall(
                r'<(?:script[^>]*src|link[^>]*href)="(https?://[^"]*)"',
                page.read_text(encoding='utf-8'))]
  assert not remote, remote[:5]


def test_the_strict_build_fails_on_a_broken_anchor(tmp_path):
  """The configuration really makes a broken #anchor an error."""
  shutil.copytree(DOCS, tmp_path / 'docs')
  shutil.copy(ROOT / 'mkdocs.yml', tmp_path / 'mkdocs.yml')
  with open(tmp_path / 'docs' / 'index.md', 'a', encoding='utf-8') as f:
    f.write('\n[gone](guide/streaming.md#no-such-heading)\n')
  out = _build(tmp_path / 'mkdocs.yml', tmp_path / 'site')
  assert out.returncode != 0, out.stdout + out.stderr
  assert 'no-such-heading' in out.stdout + out.stderr


def test_the_readme_stays_short():
  lines = README.read_text(encoding='utf-8').count('\n')
  assert lines <= README_MAX_LINES, (
      f'README.md has {lines} lines, more than {README_MAX_LINES}: move '
      'reference text to a page under docs/ and link it from the table')


def test_the_readme_keeps_the_two_commands():
  text = README.read_text(encoding='utf-8')
  assert re.search(r'^    make demo ', text, re.M), text[:2000]
  assert re.search(r'^    make test ', text, re.M), text[:2000]


def test_every_relative_link_and_anchor_resolves():
  broken = []
  for page in [README] + _pages():
    for target in _links(page):
      if re.match(r'^[a-z][a-z0-9+.-]*:', target):  # http:, mailto: ...
        continue
      path, _, anchor = target.partition('#')
      dest = (page.parent / path).resolve() if path else page
      where = f'{page.relative_to(ROOT)}: ({target})'
      if not dest.exists():
        broken.append(f'{where}: no file {dest}')
      elif anchor and dest.suffix == '.md' and anchor not in _anchors(dest):
        broken.append(f'{where}: no heading with the id #{anchor} in '
                      f'{dest.relative_to(ROOT)}')
  assert not broken, '\n'.join(broken)


def _nav_paths(node) -> set[str]:
  if isinstance(node, str):
    return {node}
  if isinstance(node, list):
    return set().union(*(_nav_paths(n) for n in node))
  if isinstance(node, dict):
    return set().union(*(_nav_paths(v) for v in node.values()))
  return set()


def test_every_page_is_in_the_nav_or_listed_as_not():
  config = _mkdocs_config()
  in_nav = _nav_paths(config['nav'])
  not_in_nav = {line.strip().lstrip('/')
                for line in (config.get('not_in_nav') or '').split('\n')
                if line.strip()}
  pages = {p.relative_to(DOCS).as_posix() for p in _pages()}
  assert pages - in_nav - not_in_nav == set(), (
      'pages under docs/ in neither the nav of mkdocs.yml nor its '
      'not_in_nav list')
  assert in_nav - pages == set(), 'nav entries of mkdocs.yml with no page'


# -- the commands, as written --------------------------------------------


class _Parsed(Exception):
  """Raised in place of parsing, carrying the parser main() built."""


def _cli_parser(monkeypatch) -> argparse.ArgumentParser:
  """The parser `beam-pyspark` itself builds: main() is run up to its
  parse_args, which hands the parser over instead of parsing (so every
  subcommand main() adds is covered, with nothing copied here)."""
  from beam_pyspark import cli

  def grab(self, *args, **kwargs):
    raise _Parsed(self)
  monkeypatch.setattr(argparse.ArgumentParser, 'parse_args', grab)
  with pytest.raises(_Parsed) as caught:
    cli.main([])
  monkeypatch.undo()
  return caught.value.args[0]


def _cli_flags(monkeypatch) -> dict[tuple[str, ...], set[str]]:
  """Each command's flags, by its words after `beam-pyspark`, e.g.
  ('job-server',); nested subcommands too."""
  found = {}

  def walk(parser, path):
    found[path] = {s for a in parser._actions for s in a.option_strings}  # pylint: disable=protected-access
    for action in parser._actions:  # pylint: disable=protected-access
      if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
        for name, child in action.choices.items():
          walk(child, path + (name,))
  walk(_cli_parser(monkeypatch), ())
  assert ('job-server',) in found, found.keys()
  return found


def _commands(text: str) -> list[str]:
  """Shell commands as shown: a line joined with its `\\` continuations,
  the comment after ` #` dropped; inline code spans on their own."""
  lines = text.split('\n')
  out, i = [], 0
  while i < len(lines):
    line = lines[i].strip()
    while line.endswith('\\') and i + 1 < len(lines):
      i += 1
      line = line[:-1] + ' ' + lines[i].strip()
    out.append(re.sub(r'\s#\s.*$', '', line))
    i += 1
  for span in re.findall(r'`([^`\n]+)`', text):
    out.append(span)
  return out


def _doc_texts():
  for page in [README] + _pages():
    yield page.relative_to(ROOT), page.read_text(encoding='utf-8')


def test_cli_flags_written_in_the_docs_exist(monkeypatch):
  flags = _cli_flags(monkeypatch)
  unknown, seen = [], 0
  for name, text in _doc_texts():
    for command in _commands(text):
      for m in re.finditer(r'beam-pyspark((?: +\S+)+)', command):
        words, path = m.group(1).split(), ()
        while words and path + (words[0],) in flags:
          path += (words.pop(0),)
        if not path:
          continue  # prose: "beam-pyspark installed", ...
        seen += 1
        for flag in re.findall(r'(?<!\S)(--[a-z][a-z0-9_-]*)', ' '.join(words)):
          if flag.split('=')[0] not in flags[path]:
            unknown.append(f'{name}: beam-pyspark {" ".join(path)} {flag}')
  assert seen >= 5, 'found too few beam-pyspark commands to check'
  assert not unknown, ('flags the CLI does not have (beam_pyspark/cli.py):\n'
                       + '\n'.join(unknown))


def _pipeline_options() -> set[str]:
  from apache_beam.options.pipeline_options import PipelineOptions
  import beam_pyspark.options  # noqa: F401  (registers the runner's own)
  return set(PipelineOptions([]).get_all_options(retain_unknown_options=False))


def _program_args(program: str) -> set[str]:
  """The program's own flags (its argparse add_argument calls), for a
  file in the repository or an importable module; none for a placeholder
  such as my_pipeline.py."""
  source = None
  if program.startswith('-m '):
    spec = importlib.util.find_spec(program[3:])
    if spec and spec.origin:
      source = pathlib.Path(spec.origin).read_text(encoding='utf-8')
  elif (ROOT / program).is_file():
    source = (ROOT / program).read_text(encoding='utf-8')
  if source is None:
    return set()
  return set(re.findall(r"add_argument\(\s*'--([a-z_]+)'", source))


def test_pipeline_options_written_in_the_docs_exist():
  options = _pipeline_options()
  unknown, seen = [], 0
  for name, text in _doc_texts():
    for command in _commands(text):
      m = re.match(r'^(?:\S*/)?python3? (-m \S+|\S+)(.*)$', command)
      if not m or not re.search(
          r'--runner=(beam_pyspark\.PySparkRunner|PortableRunner)\b',
          command):
        continue
      seen += 1
      own = _program_args(m.group(1))
      for option in re.findall(r'(?<!\S)--([a-z][a-z0-9_]*)', m.group(2)):
        if option not in options and option not in own:
          unknown.append(f'{name}: --{option} in {command[:80]}')
  assert seen >= 5, 'found too few pipeline commands to check'
  assert not unknown, ('options neither Beam nor this runner defines '
                       '(beam_pyspark/options.py):\n' + '\n'.join(unknown))


def test_the_options_table_names_real_options_and_flags(monkeypatch):
  options = _pipeline_options()
  flags = _cli_flags(monkeypatch)[('job-server',)]
  text = (DOCS / 'guide' / 'options.md').read_text(encoding='utf-8')
  rows = [r for r in text.split('\n')
          if r.startswith('| ') and not r.startswith('| ---')][1:]
  assert len(rows) >= 15, rows
  unknown = []
  for row in rows:
    runner, server = row.split(' | ')[:2]
    for option in re.findall(r'`--([a-z][a-z0-9_]*)', runner):
      if option not in options:
        unknown.append(f'pipeline option --{option}')
    for flag in re.findall(r'`(--[a-z][a-z0-9-]*)', server):
      if flag not in flags:
        unknown.append(f'job server flag {flag}')
  assert not unknown, '\n'.join(unknown)
