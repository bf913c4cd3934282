"""The package README's dependency table holds for every import.

beam_pyspark/README.md has a table of units (a top-level module or
package) and what each may import: the units named in backticks, and of
the libraries that pull in an engine or a transport, only those the row
names (``pyspark``, ``gRPC``). This walks every import statement of the
package, at module level and inside functions alike, and checks it.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / 'beam_pyspark'
# Libraries a row must name to be allowed them: the engine and transports.
GUARDED = {'pyspark': 'pyspark', 'py4j': 'pyspark', 'grpc': 'grpc'}
MAX_MODULE_LINES = 520


def _table() -> dict[str, tuple[set[str], set[str]]]:
  """unit -> (internal units it may import, guarded libraries it may)."""
  rows = {}
  text = (ROOT / 'README.md').read_text(encoding='utf-8')
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) != 2 or not cells[0].startswith('`'):
      continue
    units = re.findall(r'`([a-z_]+)/?`', cells[0])
    allowed = set(re.findall(r'`([a-z_.]+)/?`', cells[1]))
    libs = {lib for lib, marker in (('pyspark', 'pyspark'), ('grpc', 'grpc'))
            if marker in cells[1].lower() and
            f'no {marker}' not in cells[1].lower()}
    for unit in units:
      rows[unit] = (allowed, libs)
  return rows


def _modules():
  for path in sorted(ROOT.rglob('*.py')):
    rel = path.relative_to(ROOT)
    yield rel.parts[0].removesuffix('.py'), rel, path


def _imports(path: pathlib.Path):
  tree = ast.parse(path.read_text(encoding='utf-8'))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.lineno, node.module
      for alias in node.names:
        yield node.lineno, f'{node.module}.{alias.name}'


def test_the_table_names_every_unit():
  table = _table()
  units = {unit for unit, _, _ in _modules()} - {'__init__'}
  assert units - set(table) == set(), 'units missing from the README table'
  assert set(table) - units == set(), 'the table names units that are gone'


def test_every_import_is_allowed_by_the_table():
  table = _table()
  wrong = []
  for unit, rel, path in _modules():
    if unit == '__init__':
      continue
    allowed, libs = table[unit]
    for line, name in _imports(path):
      parts = name.split('.')
      if parts[0] == 'beam_pyspark' and len(parts) > 1:
        target = parts[1]
        if target != unit and target not in allowed and (
            name not in allowed and '.'.join(parts[1:3]) not in allowed):
          wrong.append(f'{rel}:{line} imports {name}')
      elif parts[0] in GUARDED and GUARDED[parts[0]] not in libs:
        wrong.append(f'{rel}:{line} imports {name}')
  assert wrong == []


@pytest.mark.parametrize('unit', ['planning', 'streaming', 'worker', 'web',
                                  'events', 'engine', 'options'])
def test_spark_free_units_import_no_spark(unit):
  _, libs = _table()[unit]
  assert 'pyspark' not in libs


def test_no_module_is_too_big_to_read():
  big = {str(rel): n for _, rel, path in _modules()
         if (n := len(path.read_text(encoding='utf-8').splitlines()))
         > MAX_MODULE_LINES}
  assert big == {}
