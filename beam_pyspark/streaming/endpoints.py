"""A streaming job's endpoints and what each trigger grants them, sans-I/O.

The endpoints of a streaming job are the live restrictions of its
splittable reads: an unbounded SDF's residuals, ``PeriodicImpulse``'s, an
``UnboundedSource``'s splits (``worker.endpoints`` runs them). The driver
keeps them between micro-batches (``EndpointBook``): a bundle that ran an
endpoint leaves residuals, which replace it; each holds its stage's output
watermark at the watermark its estimator reported (the minimum when it
reported none, as Prism does), so the source watermark is the minimum over
the residuals, +inf once none is left.

After each micro-batch the driver commits an *offer* (``EndpointBook.offer``)
with its manifest: each endpoint's backlog and when it may run again. The
query's source reads the latest committed offer at each trigger (a newer
one replaces an older: versions in between are never seen, as the seed's
metadata stream coalesces them) and grants the trigger's record budget
(``grants``): split evenly and absolutely over the endpoints ready to run
(``streaming.budget``), at most an endpoint's backlog each, the rest to
the others. The grants are part of the trigger's offset, which Spark logs
before the micro-batch runs: a micro-batch run again after a crash gets
the same grants.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable
from typing import Optional

from beam_pyspark.streaming import MIN_MICROS
from beam_pyspark.streaming.budget import split_budget


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """A live restriction of a splittable read, between micro-batches."""
  endpoint_id: str
  node: str  # the stage that reads it
  input_id: str  # the stage's data input its element enters by
  element: bytes  # the encoded sized element (element, restriction, size)
  watermark: Optional[int]  # output watermark its estimator reported
  resume_at: int  # wall-clock micros it may run again from
  backlog: Optional[float]  # its restriction's size; None: unknown
  # It had more to read than its last grant (the runner checkpointed it).
  busy: bool = False
  # Where its last bundle stopped (the last position claimed), for people.
  position: Optional[str] = None


class EndpointBook:
  """The endpoints of a job's splittable stages."""
  def __init__(self):
    self._endpoints: dict[str, Endpoint] = {}
    self._serial = 0

  def __bool__(self) -> bool:
    return bool(self._endpoints)

  def __len__(self) -> int:
    return len(self._endpoints)

  def add(self, node: str, input_id: str, element: bytes,
          watermark: Optional[int], resume_at: int,
          backlog: Optional[float], endpoint_id: Optional[str] = None,
          busy: bool = False, position: Optional[str] = None) -> Endpoint:
    """A live restriction; ``endpoint_id``: the id of the endpoint it is
    what is left of, kept (a shard keeps its id from batch to batch), if
    no endpoint has it now; else a new id."""
    if endpoint_id is None or endpoint_id in self._endpoints:
      self._serial += 1
      endpoint_id = f'{self._serial}'
    endpoint = Endpoint(endpoint_id, node, input_id, element, watermark,
                        resume_at, backlog, busy, position)
    self._endpoints[endpoint.endpoint_id] = endpoint
    return endpoint

  def of_all(self) -> list[Endpoint]:
    return list(self._endpoints.values())

  def of(self, node: str) -> list[Endpoint]:
    return [e for e in self._endpoints.values() if e.node == node]

  def nodes(self) -> set[str]:
    return {e.node for e in self._endpoints.values()}

  def take(self, grants: dict[str, Optional[int]]
           ) -> dict[str, list[tuple[Endpoint, Optional[int]]]]:
    """The granted endpoints, per node, with their grants (None: no
    record limit), taken out: what they leave comes back with ``add``.
    Grants for endpoints no longer known (never: grants come from an
    offer of this book) are refused."""
    taken: dict[str, list[tuple[Endpoint, Optional[int]]]] = {}
    for endpoint_id, grant in sorted(grants.items(), key=lambda g: _order(g[0])):
      endpoint = self._endpoints.pop(endpoint_id, None)
      if endpoint is None:
        raise KeyError(
            f'a grant for endpoint {endpoint_id}, which this job does not '
            'have: the offer it was granted from is not this checkpoint\'s')
      taken.setdefault(endpoint.node, []).append((endpoint, grant))
    return taken

  def hold(self, node: str) -> Optional[int]:
    """The node's output watermark hold: the minimum of its endpoints'
    watermarks (MIN for one that reported none); None without endpoints."""
    marks = [MIN_MICROS if e.watermark is None else e.watermark
             for e in self._endpoints.values() if e.node == node]
    return min(marks) if marks else None

  def offer(self) -> dict[str, tuple[Optional[float], int]]:
    """What the query's source grants from: endpoint id -> (backlog,
    resume_at)."""
    return {e.endpoint_id: (e.backlog, e.resume_at)
            for e in self._endpoints.values()}

  def snapshot(self) -> dict:
    return {'serial': self._serial,
            'endpoints': [dataclasses.astuple(e)
                          for e in self._endpoints.values()]}

  def restore(self, saved: dict, rename=lambda node: node) -> None:
    self._serial = saved['serial']
    self._endpoints = {}
    for fields in saved['endpoints']:
      endpoint = Endpoint(*fields)
      endpoint = dataclasses.replace(endpoint, node=rename(endpoint.node))
      self._endpoints[endpoint.endpoint_id] = endpoint

  def renamed(self, rename) -> dict:
    """``snapshot`` with nodes renamed (checkpoints use stable names)."""
    saved = self.snapshot()
    saved['endpoints'] = [
        (f[0], rename(f[1])) + tuple(f[2:]) for f in saved['endpoints']]
    return saved


def to_split(granted: list[tuple[Endpoint, Optional[int]]], live: int,
             most: int) -> set[str]:
  """Which granted endpoints of a read to split in two as they run: the
  busy ones (they had more to read than their last grant), while the
  read has fewer than ``most`` endpoints (``live`` now): a backlog
  skewed onto one restriction spreads over more endpoints, each granted
  its share of later budgets."""
  chosen = set()
  for endpoint, _ in sorted(granted, key=lambda g: _order(g[0].endpoint_id)):
    if endpoint.busy and live + len(chosen) < most:
      chosen.add(endpoint.endpoint_id)
  return chosen


def _order(endpoint_id: str):
  return (len(endpoint_id), endpoint_id)


def ready(offer: dict[str, tuple[Optional[float], int]],
          now: int) -> list[str]:
  """The offered endpoints that may run at ``now`` (wall-clock micros)."""
  return sorted((e for e, (_, resume_at) in offer.items() if resume_at <= now),
                key=_order)


def grants(offer: dict[str, tuple[Optional[float], int]], budget: Optional[int],
           now: int, rotate: int = 0) -> dict[str, Optional[int]]:
  """One trigger's grants: ``budget`` records (None: no limit) split evenly
  over the endpoints ready at ``now``: those whose restriction asked to be
  resumed by then. Their size does not cap a grant: Beam's restriction
  sizes are relative weights (bytes, or what is due by the time the size
  was taken: ``PeriodicImpulse`` sizes a restriction with nothing due yet
  at 0), not records. Endpoints granted nothing (more of them than
  records) wait for a later trigger; ``rotate`` (the trigger's number)
  turns who goes first, so none waits for ever."""
  ids = ready(offer, now)
  if not ids:
    return {}
  if budget is None:
    return {e: None for e in ids}
  shares = split_budget(budget, {e: None for e in ids}, rotate=rotate)
  return {e: g for e, g in shares.items() if g > 0}


def byte_shares(granted: Iterable[str], byte_budget: Optional[int]
                ) -> dict[str, Optional[int]]:
  """A byte budget split evenly over the granted endpoints."""
  granted = sorted(granted, key=_order)
  if byte_budget is None or not granted:
    return {e: None for e in granted}
  q, r = divmod(byte_budget, len(granted))
  return {e: q + (i < r) for i, e in enumerate(granted)}
