#!/usr/bin/env python3
"""Writes tests/module_durations.json from pytest JUnit XML reports.

    python scripts/module-durations.py report.xml [more.xml ...]

Each test module's seconds (the sum of its tests' times) order `make
test`'s modules longest first (tests/conftest.py): with pytest-xdist's
--dist=loadscope a module or class goes to one worker, and a long one
collected last (the Java ValidatesRunner suite is one pytest test of
~15 minutes) would run alone at the end while the other worker idles.
Run it on a report of a whole run (`make test PYTEST_ARGS=--junitxml=X`);
the figures only need to be right in their order of size.
"""

import collections
import json
import os
import sys
import xml.etree.ElementTree as ET

OUT = os.path.join(os.path.dirname(__file__), '..', 'tests',
                   'module_durations.json')


def main(paths):
  seconds = collections.Counter()
  for path in paths:
    for case in ET.parse(path).iter('testcase'):
      parts = case.get('classname', '').split('.')
      if len(parts) < 2 or parts[0] != 'tests':
        continue
      seconds[f'tests/{parts[1]}.py'] += float(case.get('time') or 0)
  ranked = {name: round(secs) for name, secs in seconds.most_common()}
  with open(OUT, 'w', encoding='utf-8') as f:
    json.dump(ranked, f, indent=1)
    f.write('\n')
  print(f'{len(ranked)} modules, {sum(ranked.values()) / 60:.0f} min in all '
        f'-> {os.path.normpath(OUT)}')


if __name__ == '__main__':
  main(sys.argv[1:])
