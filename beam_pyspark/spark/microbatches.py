"""The Spark side of a streaming job's query: its Python data source.

``MicroBatches`` is the streaming client of the design documents as a
Spark Structured Streaming source (spark.sources runs the query). Spark
runs it in Python processes of its own, each of which imports this
module: it imports nothing of Beam (importing ``apache_beam`` costs
seconds in every such process, which a job paid before its first
micro-batch), only the standard library, pyspark's data source API and
the runner's budget split (``streaming.endpoints``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import posixpath
import tempfile
import time
from typing import Optional

from pyspark.sql.datasource import DataSource
from pyspark.sql.datasource import DataSourceStreamReader
from pyspark.sql.datasource import InputPartition

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.storage import Location
from beam_pyspark.streaming import budget as budget_module
from beam_pyspark.streaming import endpoints

SOURCE_NAME = 'beam_pyspark_microbatches'

# A file in the query's control directory (``control_dir``) telling the
# source to offer no more micro-batches (the job is cancelled, or its
# engine has finished).
STOP_MARKER = 'query-stop'
# ... and to offer one micro-batch granting every endpoint, at once (the
# job is draining).
DRAIN_MARKER = 'query-drain'


def control_dir(location: Location) -> str:
  """Where the driver's engine and its query's source (two processes of
  the driver's machine) leave each other markers: a local location
  itself, as before; for a remote one a local directory, so the source
  asks no remote store at every trigger."""
  if location.local is not None:
    return location.local
  digest = hashlib.sha256(location.url.encode('utf-8')).hexdigest()[:20]
  path = os.path.join(tempfile.gettempdir(), 'beam-pyspark-control', digest)
  os.makedirs(path, exist_ok=True)
  return path


def request_drain(location: Location) -> None:
  _touch(os.path.join(control_dir(location), DRAIN_MARKER))


# The source's options that carry the location's storage options (Beam's
# HDFS and S3 options: ``storage``); Spark redacts those that look secret
# from its plans.
_STORAGE_PREFIX = 'storage.'


class _MicroBatchReader(DataSourceStreamReader):
  """The streaming client of the design documents, as a Spark source.

  Offsets are micro-batches: {'batch': index, 'time': wall-clock micros
  the trigger was decided at, 'grants': {endpoint id: records}}. At each
  trigger it re-reads the job's latest committed offer (the endpoints the
  engine's manifest holds, streaming.endpoints) and offers the next
  micro-batch when there is something to do: a TestStream batch not yet
  run, endpoints ready to read (granted the trigger's budget), a
  processing-time timer due; else it returns ``start`` and Spark runs no
  batch. It runs in a Python process of Spark's on the driver, not the
  engine's: files are all it shares with the engine.
  """
  def __init__(self, options: dict):
    self.location = Location.parse(options['location'], {
        k[len(_STORAGE_PREFIX):]: v for k, v in options.items()
        if k.startswith(_STORAGE_PREFIX)})
    self.control = options.get('control') or control_dir(self.location)
    self.teststream = int(options.get('teststream', '0'))
    self.wall_clock = options.get('wall_clock') == 'true'
    budget = int(options.get('budget', '0'))
    self.budget = budget if budget > 0 else None
    # The budget's growth while the reads fall behind (streaming.budget).
    self.growth = budget_module.GrowingBudget(
        int(options.get('budget_scale', '1')))
    byte_budget = int(options.get('byte_budget', '0'))
    self.byte_budget = byte_budget if byte_budget > 0 else None
    self._cached: Optional[tuple[int, dict]] = None

  def initialOffset(self) -> dict:
    """Where a query with a new checkpoint of its own starts: after the
    runner's last commit (-1: none). Spark's query checkpoint is new for
    a new job, and also when it was kept on another driver's disk (object
    stores: ``storage.Location.query_checkpoint``): the job then goes on
    from the runner's own manifests."""
    return {'batch': self._latest_manifest(), 'time': 0, 'grants': {}}

  def _latest_manifest(self) -> int:
    names = self.location.store().listdir('manifests')
    return max((int(n) for n in names if n.isdigit()), default=-1)

  def getDefaultReadLimit(self):
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from pyspark.sql.streaming.datasource import ReadMaxRows
    return ReadAllAvailable() if self.budget is None else ReadMaxRows(
        self.budget)

  def latestOffset(self, start=None, limit=None) -> dict:
    start = start or self.initialOffset()
    batch = start['batch']
    now = time.time_ns() // 1000
    if batch < 0:
      return {'batch': 0, 'time': now, 'grants': {}}
    if os.path.exists(os.path.join(self.control, STOP_MARKER)):
      return start
    offer = self._offer(batch)
    if offer.get('finished'):
      return start
    if os.path.exists(os.path.join(self.control, DRAIN_MARKER)):
      # Draining: every endpoint, now, with no record budget.
      return {'batch': batch + 1, 'time': now,
              'grants': {e: None for e in offer.get('endpoints', {})}}
    budget = getattr(limit, 'max_rows', self.budget)
    if budget is not None:
      budget = self.growth.of(budget, batch, bool(offer.get('busy')))
    granted = endpoints.grants(
        offer.get('endpoints', {}), budget, now, rotate=batch + 1)
    due = offer.get('next_processing')
    if (batch + 1 < self.teststream or granted or
        (self.wall_clock and due is not None and due <= now)):
      return {'batch': batch + 1, 'time': now, 'grants': granted}
    return start

  def _offer(self, batch: int) -> dict:
    """The latest committed manifest's offer; it must be of ``batch``
    (Spark asks for the next trigger once the last one ran, and our
    commit is part of running it): an older one is stale metadata, and
    fails the query rather than offering from it."""
    directory = self.location.join('manifests')
    latest = self._latest_manifest()
    if latest < batch:
      raise PipelineExecutionError(
          f'The streaming source\'s metadata is stale: Spark ran '
          f'micro-batch {batch}, but the latest committed manifest under '
          f'{directory} is {latest if latest >= 0 else "none"}. The '
          'checkpoint location was changed or damaged while the job ran.')
    if self._cached is None or self._cached[0] != latest:
      manifest = pickle.loads(self.location.store().read(
          posixpath.join('manifests', str(latest))))
      self._cached = (latest, manifest.driver.get('offer', {}))
    return self._cached[1]

  def partitions(self, start: dict, end: dict):
    return [InputPartition((i, end['time'], json.dumps(end['grants'])))
            for i in range(start['batch'] + 1, end['batch'] + 1)]

  def read(self, partition):
    yield partition.value

  def commit(self, end: dict) -> None:
    pass


class MicroBatches(DataSource):
  """A job's micro-batches (options: its checkpoint location, TestStream
  batches, whether processing time is the wall clock, the budgets)."""
  @classmethod
  def name(cls) -> str:
    return SOURCE_NAME

  def schema(self) -> str:
    return 'batch int, time long, grants string'

  def streamReader(self, schema):
    return _MicroBatchReader(dict(self.options))


def _touch(path: str) -> None:
  with open(path, 'a'):
    pass


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass
