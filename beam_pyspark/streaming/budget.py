"""A trigger's work budget, split evenly and absolutely over endpoints.

The streaming client of the design documents spreads its total work budget
over the backend endpoints it has open: ``q, r = divmod(budget, n)``,
endpoint i gets ``q + (i < r)``, computed from the total every time (set
absolutely: adjusting the previous shares relatively drifts). Here the
endpoints are a source's live shards with backlog, and the budget is the
records one micro-batch may read. A share an endpoint cannot use (its
backlog is smaller) goes to the others, evenly again, so the batch reads
``min(budget, total backlog)`` records whenever it can.
"""

from __future__ import annotations

from typing import Hashable
from typing import Mapping
from typing import Optional


def even_shares(budget: int, n: int) -> list[int]:
  """``budget`` over ``n`` endpoints: q + (i < r) each, summing to budget."""
  if n <= 0:
    return []
  q, r = divmod(max(0, budget), n)
  return [q + (i < r) for i in range(n)]


def split_budget(
    budget: int,
    backlogs: Mapping[Hashable, Optional[int]],
    rotate: int = 0) -> dict[Hashable, int]:
  """Grants per endpoint for one trigger.

  ``backlogs``: endpoint -> records it holds (None: unknown, take any share;
  0: none now). Endpoints are ordered by key, turned by ``rotate`` places
  (who gets the remainder's extra record first), so that the same
  endpoints, budget and rotation give the same grants on a replay. The
  grants sum to at most ``budget``; an endpoint never gets more than its
  known backlog.
  """
  grants = {endpoint: 0 for endpoint in backlogs}
  open_ = sorted((e for e, b in backlogs.items() if b is None or b > 0),
                 key=repr)
  if open_:
    turn = rotate % len(open_)
    open_ = open_[turn:] + open_[:turn]
  left = max(0, budget)
  while open_ and left > 0:
    shares = even_shares(left, len(open_))
    still_open = []
    for endpoint, share in zip(open_, shares):
      backlog = backlogs[endpoint]
      room = None if backlog is None else backlog - grants[endpoint]
      take = share if room is None else min(share, room)
      grants[endpoint] += take
      left -= take
      if room is None or take < room:
        still_open.append(endpoint)
    # Either the shares summed to what was left (now 0), or an endpoint
    # used up its backlog and leaves: each round ends the loop or shrinks it.
    open_ = still_open
  return grants


class GrowingBudget:
  """The default budget of a job's micro-batches, adapting to its backlog:
  doubled after each micro-batch whose reads had more to read than they
  were granted (an endpoint left busy: the job falls behind at this
  budget, and each micro-batch's fixed cost then weighs on fewer records),
  up to ``most`` times the base; shrunk by a quarter after each that had
  not (back to the base once caught up). An explicit budget does not
  grow (``most`` 1)."""
  def __init__(self, most: int = 1):
    self.most = max(1, most)
    self.scale = 1
    self._after: Optional[int] = None

  def of(self, base: int, after: int, busy: bool) -> int:
    """The budget of the micro-batch after micro-batch ``after``, whose
    reads left endpoints ``busy`` or not (asked again for the same one:
    the same answer)."""
    if self._after != after:
      self._after = after
      self.scale = (min(self.most, self.scale * 2) if busy else
                    max(1, self.scale * 3 // 4))
    return base * self.scale
