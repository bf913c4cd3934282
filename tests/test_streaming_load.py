"""The README's streaming example on a machine whose cores are all busy.

Spark gives the Python process it starts for a streaming query's source a
fixed 10 s to connect back (``beam_pyspark.spark.querystarts``); at load
30-90 on 2 cores 8 of 13 streaming jobs failed before their first
micro-batch. Here 8 CPU-bound processes keep both cores busy while one run
of examples/streaming_counts.py, in a process of its own as a user runs
it, starts, reads its whole source and writes every window: each event
counted once.
"""
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, 'examples', 'streaming_counts.py')
sys.path.insert(0, os.path.join(REPO, 'examples'))
from streaming_counts import WORDS  # pylint: disable=wrong-import-position

from cpu_load import busy_cores  # pylint: disable=wrong-import-position
from cpu_load import load  # pylint: disable=wrong-import-position

RUN_WAIT_SECS = 800
SECONDS, RATE = 4, 10
_FILE = re.compile(r'(\S+)-(\d{5})-of-(\d{5})\.txt$')


def test_the_streaming_example_gives_exact_output_with_every_core_busy(
    tmp_path):
  output = str(tmp_path / 'counts')
  with busy_cores():
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, EXAMPLE, '--output', output,
         '--runner=beam_pyspark.PySparkRunner', '--streaming',
         '--spark_master_url=local[2]', f'--seconds={SECONDS}',
         f'--rate={RATE}'],
        capture_output=True, text=True, cwd=REPO, timeout=RUN_WAIT_SECS,
        check=False)
    print(f'the example ran in {time.monotonic() - started:.0f} s, {load()}')
  log = run.stdout + run.stderr
  # Why it failed: Python's lines, not the JVM's frames around them.
  assert run.returncode == 0, '\n'.join(
      line for line in log.splitlines()
      if not line.startswith('\t') and 'Broken pipe' not in line)[-6000:]
  counts: dict = {}
  for name in sorted(os.listdir(output)):
    if name.startswith('.'):  # fileio's temporary directory
      continue
    window = _FILE.search(name).group(1)
    with open(os.path.join(output, name), encoding='utf-8') as f:
      for line in f.read().splitlines():
        word, count = line.split(': ')
        assert word in WORDS, line
        # A window's count of a word is one line in one of its files.
        assert (window, word) not in counts, (name, line)
        counts[window, word] = int(count)
  # Every event of the source counted once: none lost, none twice.
  assert sum(counts.values()) == SECONDS * RATE, (counts, log[-3000:])
  # Restarts of the query, if the load made them, said why.
  restarts = [line for line in log.splitlines() if 'did not start' in line]
  print(f'{len(restarts)} restarts of the query')
  for line in restarts:
    assert 'connect back within Spark\'s fixed 10 s' in line, line
