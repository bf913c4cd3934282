"""A Beam job's progress as Spark's status tracker sees it, as plain data.

A Beam job's Spark jobs are those of its job group (the engine calls
``sc.setJobGroup(job_id, ...)``), so ``sc.statusTracker()`` answers for
one Beam job without Spark's REST API (which a disabled UI would not
serve). What comes out is plain dicts and numbers: the job registry and
the status page, which know nothing of Spark, read them as they are.
"""

from __future__ import annotations

import threading
import time
from typing import Callable
from typing import Optional

# A status page polled by several browsers, and the client's progress
# line, ask often: each answer costs a few py4j calls per stage.
CACHE_SECS = 0.5


def stage_url(ui_url: Optional[str], stage_id: int, attempt: int
              ) -> Optional[str]:
  """The Spark UI's page of one stage attempt, when the UI is known."""
  if not ui_url:
    return None
  return f'{ui_url.rstrip("/")}/stages/stage/?id={stage_id}&attempt={attempt}'


def job_group_progress(tracker, job_group: str,
                       ui_url: Optional[str] = None) -> dict:
  """Tasks done/active/failed/total over the Spark jobs of ``job_group``.

  ``tracker``: a pyspark StatusTracker (or anything with its methods).
  A stage that ended with no task run was skipped (its shuffle output was
  there already): it counts for nothing, so that a finished job reads
  100%. A stage shared by several jobs counts once.
  """
  spark_jobs, stages, seen = [], [], set()
  for spark_job_id in sorted(tracker.getJobIdsForGroup(job_group)):
    info = tracker.getJobInfo(spark_job_id)
    if info is None:  # forgotten (spark.ui.retainedJobs)
      continue
    status = str(info.status)
    spark_jobs.append({'job_id': spark_job_id, 'status': status})
    for stage_id in sorted(info.stageIds):
      if stage_id in seen:
        continue
      seen.add(stage_id)
      stage = tracker.getStageInfo(stage_id)
      if stage is None:
        continue
      if (status != 'RUNNING' and stage.numCompletedTasks == 0 and
          stage.numActiveTasks == 0 and stage.numFailedTasks == 0):
        continue  # skipped
      attempt = stage.currentAttemptId
      stages.append({
          'stage_id': stage_id,
          'attempt': attempt,
          'name': stage.name,
          'total': stage.numTasks,
          'done': stage.numCompletedTasks,
          'active': stage.numActiveTasks,
          'failed': stage.numFailedTasks,
          'url': stage_url(ui_url, stage_id, attempt),
      })
  return {
      'spark_ui': ui_url,
      'spark_jobs': spark_jobs,
      'stages': stages,
      'tasks_total': sum(s['total'] for s in stages),
      'tasks_done': sum(s['done'] for s in stages),
      'tasks_active': sum(s['active'] for s in stages),
      'tasks_failed': sum(s['failed'] for s in stages),
  }


class ProgressTracker:
  """One Beam job's progress on one SparkContext, cached for CACHE_SECS."""
  def __init__(self, sc, job_group: str,
               clock: Callable[[], float] = time.monotonic):
    self._sc = sc
    self._job_group = job_group
    self._clock = clock
    self._lock = threading.Lock()
    self._last: Optional[tuple[float, dict]] = None

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
          sc.statusTracker(), self._job_group, sc.uiWebUrl)
      self._last = (now, progress)
      return progress


class _NoJobs:
  def getJobIdsForGroup(self, _group):  # pylint: disable=invalid-name
    return []
