"""Deterministic benchmark inputs: the same seed and size give the same bytes.

Only Python's ``random.Random`` is used (its ``random()`` stream and
``choices`` are stable across Python versions), so a corpus can be
regenerated anywhere instead of being shipped.  Files are cached by name,
seed and size under the corpus directory; a ``.done`` marker is written
last, so an interrupted generation is redone rather than half-used.

* ``text``     lines of words drawn from a Zipf-like vocabulary (rank r has
               weight 1/r^1.07), with some capitals and punctuation, for
               WordCount;
* ``grouped``  ``key<TAB>value`` records over few keys (many values each),
               for GroupByKey;
* ``numbers``  ``key,value`` integer records over many keys, for
               CombinePerKey;
* ``facts`` + ``dims``  ``order,user,amount`` records and a small
               ``user,country`` table, for a join through a side input.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Callable
from typing import Iterator

MB = 1 << 20
DEFAULT_SEED = 20240607

VOCABULARY_SIZE = 50_000
ZIPF_EXPONENT = 1.07
GROUP_KEYS = 500
NUMBER_KEYS = 100_000
USERS = 100_000
# Facts name users up to this multiple of USERS: about 9% find no match.
MISSING_USER_SPREAD = 1.1
COUNTRIES = [
    'AR', 'AU', 'BR', 'CA', 'CN', 'DE', 'EG', 'ES', 'FR', 'GB', 'ID', 'IN',
    'IT', 'JP', 'KE', 'KR', 'MX', 'NG', 'NL', 'PL', 'SE', 'TR', 'US', 'ZA'
]

_SYLLABLES = [
    c + v for c in 'bcdfghjklmnprstvwz' for v in ('a', 'e', 'i', 'o', 'u', 'ai', 'ou')
]
_PUNCTUATION = [',', '.', ';', ':', '!', '?', "'s", '"']

# Lines are generated in blocks of this many, then written at once.
_BLOCK = 2000


def vocabulary(seed: int = DEFAULT_SEED, size: int = VOCABULARY_SIZE) -> list[str]:
  """``size`` distinct pseudo-words, most frequent (shortest) first."""
  rng = random.Random(seed)
  words: list[str] = []
  seen = set()
  while len(words) < size:
    # Frequent words tend to be short, as in natural text.
    syllables = 1 + min(4, int(rng.expovariate(1.0) * (1 + len(words) / size * 3)))
    word = ''.join(rng.choice(_SYLLABLES) for _ in range(syllables))
    if word not in seen:
      seen.add(word)
      words.append(word)
  words.sort(key=len)
  return words


def zipf_cum_weights(n: int, exponent: float = ZIPF_EXPONENT) -> list[float]:
  return list(itertools.accumulate(1.0 / (r**exponent) for r in range(1, n + 1)))


def _text_lines(rng: random.Random) -> Iterator[str]:
  words = vocabulary()
  cum = zipf_cum_weights(len(words))
  decorated_cap = {}
  while True:
    counts = [rng.randint(6, 18) for _ in range(_BLOCK)]
    drawn = rng.choices(words, cum_weights=cum, k=sum(counts))
    flourish = rng.choices(range(40), k=len(drawn))
    pos = 0
    for count in counts:
      line = []
      for i in range(pos, pos + count):
        word = drawn[i]
        f = flourish[i]
        if f == 0:
          word = decorated_cap.get(word) or decorated_cap.setdefault(
              word, word.capitalize())
        elif f <= len(_PUNCTUATION):
          word += _PUNCTUATION[f - 1]
        line.append(word)
      pos += count
      yield ' '.join(line)


def _grouped_lines(rng: random.Random) -> Iterator[str]:
  keys = ['key%04d' % i for i in range(GROUP_KEYS)]
  while True:
    ks = rng.choices(keys, k=_BLOCK)
    for k in ks:
      yield '%s\t%d' % (k, rng.randrange(1_000_000))


def _number_lines(rng: random.Random) -> Iterator[str]:
  while True:
    for _ in range(_BLOCK):
      yield 'n%d,%d' % (rng.randrange(NUMBER_KEYS), rng.randrange(-1000, 1_000_000))


def _fact_lines(rng: random.Random) -> Iterator[str]:
  spread = int(USERS * MISSING_USER_SPREAD)
  for order in itertools.count():
    yield 'o%d,u%d,%d.%02d' % (
        order, rng.randrange(spread), rng.randrange(1, 5000), rng.randrange(100))


def _dim_lines(rng: random.Random) -> Iterator[str]:
  for user in range(USERS):
    yield 'u%d,%s' % (user, rng.choice(COUNTRIES))


_GENERATORS: dict[str, Callable[[random.Random], Iterator[str]]] = {
    'text': _text_lines,
    'grouped': _grouped_lines,
    'numbers': _number_lines,
    'facts': _fact_lines,
}


def write_lines(path: str, lines: Iterator[str], target_bytes: int) -> None:
  """Write whole lines until at least ``target_bytes`` (or lines run out)."""
  tmp = path + '.tmp'
  written = 0
  with open(tmp, 'w', encoding='utf-8', newline='\n') as f:
    while written < target_bytes:
      block = list(itertools.islice(lines, _BLOCK))
      if not block:
        break
      data = '\n'.join(block) + '\n'
      f.write(data)
      written += len(data)  # ASCII only: characters are bytes
  os.replace(tmp, path)


def ensure(
    corpus_dir: str, kind: str, size_mb: float, seed: int = DEFAULT_SEED) -> str:
  """Path of the ``kind`` corpus of ``size_mb`` MiB, generated if missing."""
  os.makedirs(corpus_dir, exist_ok=True)
  if kind == 'dims':
    name = f'dims-{USERS}-s{seed}.csv'
    target = 1 << 62  # all users
    lines = _dim_lines(random.Random(seed ^ 0xD1))
  else:
    name = f'{kind}-{size_mb:g}mb-s{seed}.txt'
    target = int(size_mb * MB)
    # Each kind has its own stream, so adding a kind changes no other one.
    lines = _GENERATORS[kind](random.Random(f'{kind}/{seed}'))
  path = os.path.join(corpus_dir, name)
  done = path + '.done'
  if not (os.path.exists(path) and os.path.exists(done)):
    write_lines(path, lines, target)
    with open(done, 'w') as f:
      f.write('ok\n')
  return path


def main(argv=None) -> None:
  import argparse
  import time
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dir', default='out/bench/corpus')
  parser.add_argument('--size-mb', type=float, default=20)
  parser.add_argument('--seed', type=int, default=DEFAULT_SEED)
  parser.add_argument(
      '--kinds', default='text,grouped,numbers,facts,dims',
      help='comma-separated: ' + ', '.join(list(_GENERATORS) + ['dims']))
  args = parser.parse_args(argv)
  for kind in args.kinds.split(','):
    start = time.monotonic()
    path = ensure(args.dir, kind, args.size_mb, args.seed)
    print(f'{path}: {os.path.getsize(path) / MB:.1f} MiB '
          f'({time.monotonic() - start:.1f}s)')


if __name__ == '__main__':
  main()
