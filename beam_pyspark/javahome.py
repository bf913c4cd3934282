"""Where the ``java`` to run is: ``$JAVA_HOME/bin/java``, else the first on
PATH (as Spark's own launch scripts choose), else None."""

from __future__ import annotations

import os
import shutil
from typing import Optional


def find_java() -> Optional[str]:
  home = os.environ.get('JAVA_HOME')
  if home and os.path.exists(os.path.join(home, 'bin', 'java')):
    return os.path.join(home, 'bin', 'java')
  return shutil.which('java')
