"""A Beam job's progress as Spark's status tracker sees it, as plain data.

A Beam job's Spark jobs are those of its job group (the engine calls
``sc.setJobGroup(job_id, ...)``), so ``sc.statusTracker()`` answers for
one Beam job without Spark's REST API (which a disabled UI would not
serve). What comes out is plain dicts and numbers: the job registry and
the status page, which know nothing of Spark, read them as they are.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable
from typing import Optional

from beam_pyspark.spark.session import master_info

# A status page polled by several browsers, and the client's progress
# line, ask often: each answer costs a few py4j calls per stage.
CACHE_SECS = 0.5
# Spark stages a job's progress lists (its page's table): the last ones.
MAX_STAGES_SHOWN = 100
RECENT_STAGES = 10000
# Points of a job's tasks-done-over-time chart.
MAX_HISTORY = 300


def stage_url(ui_url: Optional[str], stage_id: int, attempt: int
              ) -> Optional[str]:
  """The Spark UI's page of one stage attempt, when the UI is known."""
  if not ui_url:
    return None
  return f'{ui_url.rstrip("/")}/stages/stage/?id={stage_id}&attempt={attempt}'


class _Ended:
  """What the Spark jobs of a group that ended add up to: folded once,
  never asked again (a streaming job runs thousands of Spark jobs, each a
  few py4j calls per stage, and Spark forgets them past
  spark.ui.retainedJobs; this holds a few numbers, not their stages)."""
  def __init__(self):
    self.jobs: dict[int, str] = {}  # Spark job id -> its final status
    self.totals = {'total': 0, 'done': 0, 'active': 0, 'failed': 0}
    # Stage rows to show: the last MAX_STAGES_SHOWN ended ones.
    self.rows: collections.deque = collections.deque(maxlen=MAX_STAGES_SHOWN)
    # Stages counted already: a later job lists a stage it reused (its
    # shuffle output was there) with the numbers of the job that ran it.
    # Reuse is of recent stages: the last RECENT_STAGES ids are enough.
    self.counted: collections.deque = collections.deque(maxlen=RECENT_STAGES)
    self.counted_set: set[int] = set()

  def count(self, row: dict) -> bool:
    """Counts a stage once; whether it was new."""
    if row['stage_id'] in self.counted_set:
      return False
    if len(self.counted) == self.counted.maxlen:
      self.counted_set.discard(self.counted[0])
    self.counted.append(row['stage_id'])
    self.counted_set.add(row['stage_id'])
    return True


def job_group_progress(tracker, job_group: str,
                       ui_url: Optional[str] = None,
                       ended: Optional[_Ended] = None) -> dict:
  """Tasks done/active/failed/total over the Spark jobs of ``job_group``.

  ``tracker``: a pyspark StatusTracker (or anything with its methods).
  A stage that ended with no task run was skipped (its shuffle output was
  there already): it counts for nothing, so that a finished job reads
  100%. A stage shared by several jobs counts once. ``ended``: the jobs
  of earlier calls that ended, kept by the caller (ProgressTracker).
  """
  ended = _Ended() if ended is None else ended
  running = []
  for spark_job_id in sorted(tracker.getJobIdsForGroup(job_group)):
    if spark_job_id in ended.jobs:
      continue
    info = tracker.getJobInfo(spark_job_id)
    if info is None:  # forgotten (spark.ui.retainedJobs)
      continue
    status = str(info.status)
    rows = _stage_rows(tracker, info.stageIds, status, ui_url)
    if status in ('SUCCEEDED', 'FAILED'):
      ended.jobs[spark_job_id] = status
      for row in rows:
        if ended.count(row):
          ended.rows.append(row)
          for key in ended.totals:
            ended.totals[key] += row[key]
    else:
      running.append((spark_job_id, status, rows))
  stages = list(ended.rows)
  totals = dict(ended.totals)
  seen = set(ended.counted_set)
  for _, _, rows in running:
    for row in rows:
      if row['stage_id'] not in seen:
        seen.add(row['stage_id'])
        stages.append(row)
        for key in totals:
          totals[key] += row[key]
  spark_jobs = [{'job_id': j, 'status': s} for j, s in ended.jobs.items()]
  spark_jobs += [{'job_id': j, 'status': s} for j, s, _ in running]
  return {
      'spark_ui': ui_url,
      'spark_jobs': sorted(spark_jobs, key=lambda j: j['job_id'])[
          -MAX_STAGES_SHOWN:],
      'spark_jobs_count': len(spark_jobs),
      'stages': sorted(stages, key=lambda r: r['stage_id'])[
          -MAX_STAGES_SHOWN:],
      'tasks_total': totals['total'],
      'tasks_done': totals['done'],
      'tasks_active': totals['active'],
      'tasks_failed': totals['failed'],
  }


def _stage_rows(tracker, stage_ids, status: str,
                ui_url: Optional[str]) -> list[dict]:
  rows = []
  for stage_id in sorted(stage_ids):
    stage = tracker.getStageInfo(stage_id)
    if stage is None:
      continue
    if (status != 'RUNNING' and stage.numCompletedTasks == 0 and
        stage.numActiveTasks == 0 and stage.numFailedTasks == 0):
      continue  # skipped
    attempt = stage.currentAttemptId
    rows.append({
        'stage_id': stage_id,
        'attempt': attempt,
        'name': stage.name,
        'total': stage.numTasks,
        'done': stage.numCompletedTasks,
        'active': stage.numActiveTasks,
        'failed': stage.numFailedTasks,
        'url': stage_url(ui_url, stage_id, attempt),
    })
  return rows


class ProgressTracker:
  """One Beam job's progress on one SparkContext, cached for CACHE_SECS."""
  def __init__(self, sc, job_group: str,
               clock: Callable[[], float] = time.monotonic):
    self._sc = sc
    self._job_group = job_group
    self._clock = clock
    self._lock = threading.Lock()
    self._last: Optional[tuple[float, dict]] = None
    self._ended = _Ended()
    # Tasks done over time, one point a snapshot (its page's chart); the
    # oldest half thinned out when full.
    self._history: list[dict] = []
    # The master as asked and as Spark resolved it (the status page's).
    self._master: Optional[dict] = None

  def snapshot(self, max_age: float = CACHE_SECS) -> dict:
    with self._lock:
      now = self._clock()
      if self._last is not None and now - self._last[0] < max_age:
        return self._last[1]
      sc = self._sc
      if getattr(sc, '_jsc', None) is None:  # the context was stopped
        return self._last[1] if self._last else job_group_progress(
            _NoJobs(), self._job_group)
      progress = job_group_progress(
          sc.statusTracker(), self._job_group, sc.uiWebUrl, self._ended)
      self._history.append({'time': round(time.time(), 3),
                            'done': progress['tasks_done'],
                            'total': progress['tasks_total']})
      if len(self._history) > MAX_HISTORY:
        half = len(self._history) // 2
        self._history[:half] = self._history[:half:2]
      progress['history'] = list(self._history)
      if self._master is None:  # a py4j call, once
        self._master = master_info(sc)
      progress['master'] = self._master
      self._last = (now, progress)
      return progress


class _NoJobs:
  def getJobIdsForGroup(self, _group):  # pylint: disable=invalid-name
    return []


# An action that checked its engine's cancel flag just before a cancel
# submits its Spark job just after: cancelJobGroup, which cancels only the
# jobs active then, missed it ("Cannot find active jobs for it") and it ran
# on, the cancel lost (a job server's SIGTERM right after a job started:
# FAILED, "did not stop within 10 s of its cancel", CI). The group is
# looked at again for a while, and its jobs cancelled if one runs.
RECANCEL_SECS = 0.25
RECANCEL_FOR_SECS = 30.0


def cancel_group(sc, group: str) -> None:
  """Cancels the Spark jobs of ``group``, and those that start in the next
  RECANCEL_FOR_SECS (from a thread of its own)."""
  sc.cancelJobGroup(group)

  def again():
    deadline = time.monotonic() + RECANCEL_FOR_SECS
    while time.monotonic() < deadline:
      time.sleep(RECANCEL_SECS)
      try:
        tracker = sc.statusTracker()
        active = set(tracker.getActiveJobsIds())
        if active and active & set(tracker.getJobIdsForGroup(group)):
          sc.cancelJobGroup(group)
      except Exception:  # pylint: disable=broad-except
        return  # the context stopped

  threading.Thread(target=again, name=f'beam-pyspark-cancel-{group}',
                   daemon=True).start()
