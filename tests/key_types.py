"""Key types Beam's deterministic coder encodes itself (pickled types), in
an importable module as user code would have them (test_semantics_reshuffle)."""

import dataclasses
import enum
import typing


class NamedKey(typing.NamedTuple):
  a: int
  b: str


@dataclasses.dataclass(frozen=True)
class DataKey:
  a: int
  b: str


class Color(enum.Enum):
  RED = 1
  BLUE = 2


def keys(kind: str, i: int):
  return {
      'namedtuple': lambda: NamedKey(i % 2, 'x'),
      'dataclass': lambda: DataKey(i % 2, 'x'),
      'enum': lambda: Color.RED if i % 2 else Color.BLUE,
      'tuple': lambda: (i % 2, 'x'),
  }[kind]()
