#!/usr/bin/env python3
"""Writes tests/scope_durations.json from pytest JUnit XML reports.

    python scripts/scope-durations.py report.xml [more.xml ...]

The seconds of each scope of pytest-xdist's --dist=loadscope (a test
class, or a module's test functions: what goes to one worker) order `make
test`'s scopes longest first (tests/conftest.py): a long one collected
last (the Java ValidatesRunner suite is one pytest test of ~15 minutes)
would run alone at the end while the other worker idles.
Run it on a report of a whole run (`make test PYTEST_ARGS=--junitxml=X`);
the figures only need to be right in their order of size.
"""

import collections
import json
import os
import sys
import xml.etree.ElementTree as ET

OUT = os.path.join(os.path.dirname(__file__), '..', 'tests',
                   'scope_durations.json')


def main(paths):
  seconds = collections.Counter()
  for path in paths:
    for case in ET.parse(path).iter('testcase'):
      parts = case.get('classname', '').split('.')
      if len(parts) < 2 or parts[0] != 'tests':
        continue
      # tests.test_x -> tests/test_x.py; tests.test_x.Class -> ...::Class
      scope = '::'.join([f'tests/{parts[1]}.py', *parts[2:]])
      seconds[scope] += float(case.get('time') or 0)
  ranked = {name: round(secs) for name, secs in seconds.most_common()}
  with open(OUT, 'w', encoding='utf-8') as f:
    json.dump(ranked, f, indent=1)
    f.write('\n')
  print(f'{len(ranked)} scopes, {sum(ranked.values()) / 60:.0f} min in all '
        f'-> {os.path.normpath(OUT)}')


if __name__ == '__main__':
  main(sys.argv[1:])
