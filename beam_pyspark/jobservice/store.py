"""The job store: what must survive a job-server restart.

An embedded SQLite database by default: job id, name, pipeline options,
state history, the last messages and final metrics. One connection and a
lock around every statement keep it safe to use from gRPC's thread pool.
Write-ahead logging with NORMAL sync keeps a message's insert cheap (no
fsync per commit); incremental auto-vacuum gives pages of evicted jobs
back to the file system.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from typing import Optional

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY,
  job_name TEXT NOT NULL,
  options TEXT NOT NULL,
  created REAL NOT NULL,
  staging_token TEXT,
  pipeline BLOB,
  metrics BLOB
);
CREATE TABLE IF NOT EXISTS states (
  job_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  ts REAL NOT NULL,
  state INTEGER NOT NULL,
  PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS messages (
  job_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  ts REAL NOT NULL,
  importance INTEGER NOT NULL,
  text TEXT NOT NULL,
  PRIMARY KEY (job_id, seq)
);
"""

# Messages kept per job: its last ones, which hold its end and its error.
DEFAULT_MAX_MESSAGES = 1000


@dataclasses.dataclass
class JobRecord:
  job_id: str
  job_name: str
  options: dict
  created: float
  staging_token: Optional[str] = None
  pipeline: Optional[bytes] = None
  metrics: list[bytes] = dataclasses.field(default_factory=list)
  states: list[tuple[float, int]] = dataclasses.field(default_factory=list)


class JobStore:
  def __init__(self, path: str = ':memory:',
               max_messages: int = DEFAULT_MAX_MESSAGES):
    self._path = path
    self._max_messages = max_messages
    self._lock = threading.Lock()
    self._message_seq: dict[str, int] = {}
    # ':memory:' databases vanish with their connection: keep one open.
    self._conn = sqlite3.connect(path, check_same_thread=False)
    with self._lock:
      (vacuum,) = self._conn.execute('PRAGMA auto_vacuum').fetchone()
      if vacuum != 2:  # INCREMENTAL; an existing file needs a VACUUM to switch
        self._conn.execute('PRAGMA auto_vacuum = INCREMENTAL')
        self._conn.execute('VACUUM')
      if path != ':memory:':
        self._conn.execute('PRAGMA journal_mode = WAL')
        self._conn.execute('PRAGMA synchronous = NORMAL')
      self._conn.executescript(_SCHEMA)
      self._conn.commit()

  def close(self) -> None:
    with self._lock:
      self._conn.close()

  def put_job(self, record: JobRecord) -> None:
    with self._lock:
      self._conn.execute(
          'INSERT INTO jobs (job_id, job_name, options, created, '
          'staging_token, pipeline) VALUES (?, ?, ?, ?, ?, ?)',
          (record.job_id, record.job_name, json.dumps(record.options),
           record.created, record.staging_token, record.pipeline))
      self._conn.commit()

  def add_state(self, job_id: str, ts: float, state: int) -> None:
    with self._lock:
      (seq,) = self._conn.execute(
          'SELECT COUNT(*) FROM states WHERE job_id = ?', (job_id,)).fetchone()
      self._conn.execute(
          'INSERT INTO states (job_id, seq, ts, state) VALUES (?, ?, ?, ?)',
          (job_id, seq, ts, state))
      self._conn.commit()

  def add_message(self, job_id: str, ts: float, importance: int,
                  text: str) -> None:
    """Keeps the job's last ``max_messages`` messages."""
    with self._lock:
      seq = self._message_seq.get(job_id)
      if seq is None:
        (last,) = self._conn.execute(
            'SELECT MAX(seq) FROM messages WHERE job_id = ?',
            (job_id,)).fetchone()
        seq = -1 if last is None else last
      seq += 1
      self._message_seq[job_id] = seq
      self._conn.execute(
          'INSERT INTO messages (job_id, seq, ts, importance, text) '
          'VALUES (?, ?, ?, ?, ?)', (job_id, seq, ts, importance, text))
      if seq >= self._max_messages:
        self._conn.execute(
            'DELETE FROM messages WHERE job_id = ? AND seq <= ?',
            (job_id, seq - self._max_messages))
      self._conn.commit()

  def messages(self, job_id: str) -> list[tuple[float, int, str]]:
    with self._lock:
      return [tuple(r) for r in self._conn.execute(
          'SELECT ts, importance, text FROM messages WHERE job_id = ? '
          'ORDER BY seq', (job_id,)).fetchall()]

  def set_metrics(self, job_id: str, metrics: list[bytes]) -> None:
    with self._lock:
      self._conn.execute(
          'UPDATE jobs SET metrics = ? WHERE job_id = ?',
          (json.dumps([m.hex() for m in metrics]).encode(), job_id))
      self._conn.commit()

  def delete_job(self, job_id: str) -> None:
    with self._lock:
      self._message_seq.pop(job_id, None)
      for table in ('jobs', 'states', 'messages'):
        self._conn.execute(f'DELETE FROM {table} WHERE job_id = ?', (job_id,))
      self._conn.commit()
      # Frees the deleted pages. Through execute() Python steps the pragma
      # once, freeing one page; executescript runs it to the end.
      self._conn.executescript('PRAGMA incremental_vacuum;')

  def jobs(self) -> list[JobRecord]:
    with self._lock:
      rows = self._conn.execute(
          'SELECT job_id, job_name, options, created, staging_token, '
          'pipeline, metrics FROM jobs ORDER BY created').fetchall()
      states = self._conn.execute(
          'SELECT job_id, ts, state FROM states ORDER BY job_id, seq').fetchall()
    by_job: dict[str, list] = {}
    for job_id, ts, state in states:
      by_job.setdefault(job_id, []).append((ts, state))
    return [
        JobRecord(
            job_id=r[0],
            job_name=r[1],
            options=json.loads(r[2]),
            created=r[3],
            staging_token=r[4],
            pipeline=r[5],
            metrics=[bytes.fromhex(h) for h in json.loads(r[6])] if r[6] else [],
            states=by_job.get(r[0], [])) for r in rows
    ]
