"""A job's progress where its program runs (PySparkRunner's --progress).

``auto`` on a terminal: one stderr line, rewritten at most once a second
(stage k/n, its transforms, Spark tasks, elements); ``auto`` off a
terminal, or ``log``: an INFO line every 30 s; ``off``: nothing. Then a
closing summary: state, duration, the largest counters. It reads plain
data only (the engine's progress dict, MonitoringInfos), as the status
page does; the runner hands it the job's stages and where to read.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from typing import Callable
from typing import Optional
from typing import TextIO

from apache_beam.metrics import monitoring_infos as mi

from beam_pyspark.events import state_name

AUTO, LOG, OFF = 'auto', 'log', 'off'
MODES = (AUTO, LOG, OFF)
TERMINAL_SECS = 1.0
LOG_SECS = 30.0
TOP_COUNTERS = 5


def elements(infos) -> int:
  """Beam's element counts, summed over the job's PCollections."""
  return sum(int(mi.extract_counter_value(i)) for i in infos
             if i.urn == mi.ELEMENT_COUNT_URN)


def current_stage(stages: list[tuple[str, list[str]]],
                  tasks_done: dict[str, int]) -> int:
  """The index of the stage running now, as far as ended tasks tell: the
  one after the furthest stage any of whose tasks ended (the last stage
  once that one reported). Fused stages report when their tasks end, and
  a Spark stage can run several of them, so this is an estimate."""
  reported = [i for i, (name, _) in enumerate(stages) if tasks_done.get(name)]
  if not reported:
    return 0
  return min(len(stages) - 1, reported[-1] + 1)


def progress_line(job_id: str, stages: list[tuple[str, list[str]]],
                  progress: Optional[dict], infos) -> str:
  parts = [job_id]
  progress = progress or {}
  if stages:
    k = current_stage(stages, progress.get('beam_stages') or {})
    transforms = ', '.join(stages[k][1][:3]) or stages[k][0]
    if len(stages[k][1]) > 3:
      transforms += ', ...'
    parts.append(f'stage {k + 1}/{len(stages)} ({transforms})')
  if progress.get('tasks_total'):
    parts.append(f'tasks {progress["tasks_done"]}/{progress["tasks_total"]}'
                 + (f' ({progress["tasks_active"]} running)'
                    if progress.get('tasks_active') else ''))
  parts.append(f'{elements(infos):,} elements')
  return ' | '.join(parts)


def summary(job_id: str, state: int, seconds: Optional[float], infos) -> str:
  counters = []
  for info in infos:
    if mi.is_user_monitoring_info(info) and mi.is_counter(info):
      labels = info.labels
      counters.append((int(mi.extract_counter_value(info)),
                       f'{labels.get(mi.NAMESPACE_LABEL, "")}/'
                       f'{labels.get(mi.NAME_LABEL, "")}'))
  counters.sort(key=lambda c: (-c[0], c[1]))
  text = f'Job {job_id} {state_name(state)}'
  if seconds is not None:
    text += f' in {seconds:.1f} s'
  if counters:
    text += '; counters: ' + ', '.join(
        f'{name}={value:,}' for value, name in counters[:TOP_COUNTERS])
    if len(counters) > TOP_COUNTERS:
      text += f' (+{len(counters) - TOP_COUNTERS} more)'
  return text


class ProgressReporter:
  """Reports one job's progress until ``wait_ended`` says it ended.

  ``wait_ended(timeout) -> Optional[int]``: blocks up to ``timeout`` and
  returns the job's terminal state, or None while it runs. ``stages()``:
  the job's fused stages as (name, transform names), once planned;
  ``links()``: where to watch the job (printed once on a terminal).
  """
  def __init__(self, mode: str, job_id: str,
               stages: Callable[[], list[tuple[str, list[str]]]],
               progress: Callable[[], Optional[dict]],
               metrics: Callable[[], list],
               wait_ended: Callable[[float], Optional[int]],
               stream: TextIO, logger: logging.Logger,
               links: Callable[[], str] = lambda: '',
               clock: Callable[[], float] = time.monotonic):
    self.mode = mode
    self.job_id = job_id
    self._stages = stages
    self._links = links
    self._linked = False
    self._progress = progress
    self._metrics = metrics
    self._wait_ended = wait_ended
    self._stream = stream
    self._logger = logger
    self._clock = clock
    self._shown = 0  # characters of the line on the terminal now
    self._thread: Optional[threading.Thread] = None

  def start(self) -> 'ProgressReporter':
    if self.mode != OFF:
      self._thread = threading.Thread(
          target=self._run, name=f'progress-{self.job_id}', daemon=True)
      self._thread.start()
    return self

  def join(self, timeout: float = 5.0) -> None:
    if self._thread is not None:
      self._thread.join(timeout)

  def _line(self) -> str:
    progress = self._progress()
    if self.mode == AUTO and progress is not None and not self._linked:
      # Once the engine runs: where to watch it, above the progress line
      # (the log has it already, from the job's messages).
      self._linked = True
      links = self._links()
      if links:
        self._rewrite('')
        print(f'Job {self.job_id}: {links}', file=self._stream, flush=True)
    return progress_line(self.job_id, self._stages(), progress,
                         self._metrics())

  def _run(self) -> None:
    started = self._clock()
    every = TERMINAL_SECS if self.mode == AUTO else LOG_SECS
    while True:
      state = self._wait_ended(every)
      if state is not None:
        break
      try:
        line = self._line()
      except Exception:  # pylint: disable=broad-except
        continue  # progress is best effort; the job goes on
      if self.mode == AUTO:
        self._rewrite(line)
      else:
        self._logger.info('%s', line)
    if self.mode == AUTO:
      self._rewrite('')
    text = summary(self.job_id, state, self._clock() - started,
                   self._metrics())
    if self.mode == AUTO:
      print(text, file=self._stream, flush=True)
    else:
      self._logger.info('%s', text)

  def _rewrite(self, line: str) -> None:
    """Replaces the terminal's line (cut to its width: a wrapped line
    cannot be rewritten with a carriage return)."""
    width = shutil.get_terminal_size((100, 20)).columns - 1
    line = line[:width]
    pad = ' ' * max(0, self._shown - len(line))
    self._stream.write('\r' + line + pad + ('\r' + line if pad else ''))
    self._stream.flush()
    self._shown = len(line)
