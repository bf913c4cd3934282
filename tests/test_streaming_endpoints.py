"""A streaming job's endpoints and their grants, sans-I/O (no Spark): the
budget split over whatever endpoints there are, trigger after trigger, and
the query source's reading of the latest committed offer."""

from __future__ import annotations

import os
import pickle
import random

import pytest

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.spark.sources import STOP_MARKER
from beam_pyspark.spark.sources import _MicroBatchReader
from beam_pyspark.streaming import MIN_MICROS
from beam_pyspark.streaming.budget import split_budget
from beam_pyspark.streaming.checkpoints import Manifest
from beam_pyspark.streaming.endpoints import EndpointBook
from beam_pyspark.streaming.endpoints import byte_shares
from beam_pyspark.streaming.endpoints import grants

NOW = 1_000_000_000


def _offer(n: int, resume_at: int = 0) -> dict:
  return {str(i): (None, resume_at) for i in range(n)}


@pytest.mark.parametrize('seed', range(5))
def test_grants_sum_to_the_budget_and_differ_by_at_most_one_whatever_the_churn(
    seed):
  """Endpoints come and go (splits, finished restrictions, delays) from
  trigger to trigger: every trigger's grants are set from the budget
  afresh, sum to it, and differ by at most one record among the endpoints
  ready to run (with fewer records than endpoints, one each to as many as
  there are records)."""
  rng = random.Random(seed)
  book = EndpointBook()
  for _ in range(3):
    book.add('read', 'in', b'r', None, 0, None)
  for trigger in range(200):
    # Churn: the granted endpoints are taken and come back as 0-3
    # residuals each; some ask to be resumed later.
    offer = book.offer()
    budget = rng.choice([1, 7, 100, 1000, 12345])
    granted = grants(offer, budget, NOW, rotate=trigger)
    ready = [e for e, (_, at) in offer.items() if at <= NOW]
    assert set(granted) <= set(ready)
    if ready:
      assert sum(granted.values()) == budget
      shares = [granted.get(e, 0) for e in ready]
      assert max(shares) - min(shares) <= 1
      assert len(granted) == min(len(ready), budget)
    for node, taken in book.take(granted).items():
      for endpoint, _ in taken:
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
          later = rng.random() < 0.2
          book.add(node, endpoint.input_id, endpoint.element, None,
                   NOW + 1 if later else NOW, None)
    if not book:
      book.add('read', 'in', b'r', None, 0, None)


def test_fewer_records_than_endpoints_go_round_so_none_waits_for_ever():
  offer = _offer(5)
  served = set()
  for trigger in range(5):
    granted = grants(offer, 2, NOW, rotate=trigger)
    assert sum(granted.values()) == 2
    served |= set(granted)
  assert served == set(offer)


def test_only_endpoints_due_are_granted_and_no_budget_means_no_limit():
  offer = {'1': (5.0, NOW - 1), '2': (None, NOW), '3': (100.0, NOW + 1)}
  assert set(grants(offer, 10, NOW)) == {'1', '2'}
  assert grants(offer, None, NOW) == {'1': None, '2': None}
  assert grants({}, 10, NOW) == {}
  # A restriction's size is a weight, not records: it does not cap a grant.
  assert grants({'1': (0.0, 0)}, 10, NOW) == {'1': 10}


def test_byte_budget_split_evenly_over_the_granted():
  assert byte_shares(['1', '2', '3'], 10) == {'1': 4, '2': 3, '3': 3}
  assert byte_shares(['1'], None) == {'1': None}


def test_split_budget_rotation_turns_who_gets_the_remainder():
  assert split_budget(1, {'a': None, 'b': None}, rotate=0) == {'a': 1, 'b': 0}
  assert split_budget(1, {'a': None, 'b': None}, rotate=1) == {'a': 0, 'b': 1}


def test_the_hold_is_the_slowest_endpoints_watermark():
  book = EndpointBook()
  assert book.hold('read') is None
  book.add('read', 'in', b'a', 500, 0, None)
  book.add('read', 'in', b'b', 300, 0, None)
  book.add('other', 'in', b'c', 10, 0, None)
  assert book.hold('read') == 300
  # One whose estimator reported nothing holds at the minimum (as Prism).
  book.add('read', 'in', b'd', None, 0, None)
  assert book.hold('read') == MIN_MICROS
  taken = book.take({'4': 10})
  assert [e.element for e, _ in taken['read']] == [b'd']
  assert book.hold('read') == 300


def test_a_grant_for_an_unknown_endpoint_is_refused():
  book = EndpointBook()
  book.add('read', 'in', b'a', None, 0, None)
  with pytest.raises(KeyError, match='endpoint 7'):
    book.take({'7': 1})


def test_the_book_survives_a_checkpoint_with_stable_names():
  book = EndpointBook()
  book.add('stage-1', 'in', b'a', 5, 7, 2.0)
  saved = book.renamed(lambda n: 'stable:' + n)
  again = EndpointBook()
  again.restore(pickle.loads(pickle.dumps(saved)),
                rename=lambda n: n.replace('stable:', ''))
  assert again.offer() == book.offer()
  assert again.of('stage-1')[0].element == b'a'
  # Ids keep counting from where they were: no id names two endpoints.
  assert again.add('stage-1', 'in', b'b', None, 0, None).endpoint_id == '2'


# -- the query's source reads the latest committed offer -------------------------


def _commit(location, batch: int, offer: dict) -> None:
  directory = os.path.join(location, 'manifests')
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, str(batch)), 'wb') as f:
    pickle.dump(Manifest(batch, 'fp', {}, {'offer': offer}), f)


def _reader(location, **options):
  defaults = {'location': str(location), 'teststream': '0',
              'wall_clock': 'true', 'budget': '10'}
  defaults.update({k: str(v) for k, v in options.items()})
  return _MicroBatchReader(defaults)


def test_the_first_micro_batch_is_always_offered(tmp_path):
  offset = _reader(tmp_path).latestOffset(None, None)
  assert offset['batch'] == 0 and offset['grants'] == {}


def test_the_newest_offer_is_read_and_versions_between_are_never_seen(tmp_path):
  reader = _reader(tmp_path)
  _commit(tmp_path, 3, {'endpoints': {'1': (None, 0)}})
  _commit(tmp_path, 4, {'endpoints': {'2': (None, 0), '3': (None, 0)}})
  _commit(tmp_path, 5, {'endpoints': {'9': (None, 0)}})
  offset = reader.latestOffset({'batch': 5, 'time': 0, 'grants': {}}, None)
  assert offset['batch'] == 6 and offset['grants'] == {'9': 10}


def test_stale_metadata_fails_loudly(tmp_path):
  _commit(tmp_path, 2, {'endpoints': {'1': (None, 0)}})
  with pytest.raises(PipelineExecutionError, match='stale.*micro-batch 3'):
    _reader(tmp_path).latestOffset({'batch': 3, 'time': 0, 'grants': {}},
                                   None)


def test_nothing_due_offers_no_micro_batch(tmp_path):
  start = {'batch': 1, 'time': 0, 'grants': {}}
  far = 2**62
  _commit(tmp_path, 1, {'endpoints': {'1': (None, far)},
                        'next_processing': far})
  assert _reader(tmp_path).latestOffset(start, None) == start
  # A processing-time timer due on the wall clock is something to do.
  _commit(tmp_path, 1, {'endpoints': {}, 'next_processing': 5})
  assert _reader(tmp_path).latestOffset(start, None)['batch'] == 2
  # ... but not with a TestStream's clock.
  assert _reader(tmp_path, wall_clock='false').latestOffset(
      start, None) == start
  # TestStream batches are offered one per trigger until they run out.
  assert _reader(tmp_path, teststream=3).latestOffset(start, None)[
      'batch'] == 2


def test_a_finished_or_stopped_job_offers_nothing(tmp_path):
  start = {'batch': 1, 'time': 0, 'grants': {}}
  _commit(tmp_path, 1, {'endpoints': {'1': (None, 0)}, 'finished': True})
  assert _reader(tmp_path).latestOffset(start, None) == start
  _commit(tmp_path, 1, {'endpoints': {'1': (None, 0)}})
  (tmp_path / STOP_MARKER).touch()
  assert _reader(tmp_path).latestOffset(start, None) == start


def test_busy_endpoints_are_split_while_the_read_has_room():
  from beam_pyspark.streaming.endpoints import to_split
  book = EndpointBook()
  busy = book.add('read', 'in', b'a', None, 0, None, busy=True)
  idle = book.add('read', 'in', b'b', None, 0, None)
  other = book.add('read', 'in', b'c', None, 0, None, busy=True)
  granted = [(busy, 10), (idle, 10), (other, 10)]
  # Three live, room for four: one split, the first busy one.
  assert to_split(granted, live=3, most=4) == {busy.endpoint_id}
  assert to_split(granted, live=3, most=8) == {busy.endpoint_id,
                                              other.endpoint_id}
  assert to_split(granted, live=4, most=4) == set()
  # What is left of a split endpoint keeps its id (its first residual).
  taken = book.take({busy.endpoint_id: 10})
  again = book.add('read', 'in', b'a2', None, 0, None,
                   endpoint_id=taken['read'][0][0].endpoint_id)
  assert again.endpoint_id == busy.endpoint_id
  assert book.add('read', 'in', b'a3', None, 0, None,
                  endpoint_id=busy.endpoint_id).endpoint_id != busy.endpoint_id


def test_the_default_budget_grows_while_the_reads_fall_behind(tmp_path):
  # budget_scale: how far it may grow (an explicit budget: 1, never).
  reader, fixed = _reader(tmp_path, budget_scale=4), _reader(tmp_path)

  def granted(r, batch: int, busy: bool) -> int:
    _commit(tmp_path, batch, {'endpoints': {'1': (None, 0)}, 'busy': busy})
    start = {'batch': batch, 'time': 0, 'grants': {}}
    offset = r.latestOffset(start, None)
    # Asked again for the same trigger: the same grant.
    assert r.latestOffset(start, None)['grants'] == offset['grants']
    return offset['grants']['1']

  # Busy (more left than granted): doubled each time, up to 4 times.
  assert [granted(reader, b, True) for b in range(1, 5)] == [20, 40, 40, 40]
  # Caught up: back down a quarter at a time, to the budget.
  assert [granted(reader, b, False) for b in range(5, 10)] == [
      30, 20, 10, 10, 10]
  assert [granted(fixed, b, True) for b in range(10, 12)] == [10, 10]
