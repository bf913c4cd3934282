"""Boot programs for SDK harnesses of PROCESS environments, one per SDK.

    python -m beam_pyspark.boot <sdk> [the runner's boot flags]

A pipeline whose environment is PROCESS names a command; the runner starts
it on the executor with the flags of Beam's container boot programs. With
this module as the command, every SDK's harness starts as Beam's container
would start it, from what the runner provisions (the job's options and the
environment's staged artifacts, retrieved over the Fn API): ``common``
does the provisioning, ``boot.<sdk>.main(context)`` starts the harness.
"""

from __future__ import annotations

import importlib
import logging
import sys

SDKS = ('java', 'go', 'typescript', 'python')


def main(argv: list[str]) -> int:
  from beam_pyspark.boot import common  # pylint: disable=import-outside-toplevel
  # force: importing Beam (common does) already logged a warning through
  # the root logger, which gave it a WARNING handler; without force the
  # boot's INFO lines (which harness it starts, how) were never seen.
  logging.basicConfig(
      level=logging.INFO, format='%(asctime)s boot %(levelname)s %(message)s',
      force=True)
  if not argv or argv[0] not in SDKS:
    print(f'usage: python -m beam_pyspark.boot {{{",".join(SDKS)}}} '
          '[--id ... --provision_endpoint ...]', file=sys.stderr)
    return 2
  sdk = argv[0]
  try:
    module = importlib.import_module(f'beam_pyspark.boot.{sdk}')
  except ImportError as exn:
    print(f'boot: no boot for the {sdk} SDK here: {exn}', file=sys.stderr)
    return 2
  try:
    module.main(common.boot_context(argv[1:]))
  except common.BootError as exn:
    print(f'boot ({sdk}): {exn}', file=sys.stderr)
    return 1
  return 0
