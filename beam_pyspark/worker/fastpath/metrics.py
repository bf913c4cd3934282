"""User metrics in the fast path's loop, kept per step as the harness keeps
them.

Beam's metric objects (``Metrics.counter(...).inc()``) hand each update to
the thread's current tracker (``statesampler.get_current_tracker()``):
in the harness, the state sampler, which puts it in the container of the
operation running. While the loop runs, the tracker is a ``Tracker``: an
update goes to the container of the step whose code made it, known from
``step`` (which the loop sets before each call once it has seen an
update: ``codegen``'s metered loops) or, before that, from the loop's
own frame on the stack, the line of the call that is running
(``locate``). An element's updates are held until its outputs are
committed (``pending``), so that an element the harness does again after
a fallback is not counted twice.

Updates the loop cannot place (the source's, while it reads; code asking
for the current container itself) mark the tracker ``touched``: the
harness does that element again.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

from apache_beam.metrics.cells import CounterCell
from apache_beam.metrics.execution import MetricsContainer

_INT64 = 1 << 63


class Tracker:
  __slots__ = ('step', 'pending', 'touched', 'alert', 'learned', 'lines')

  def __init__(self):
    self.step: Optional[MetricsContainer] = None
    self.pending: list = []
    self.touched = False  # an update the loop cannot place
    self.alert = False  # touched, or an update placed by its frame
    self.learned = False  # ... which asks for a metered loop
    # The loop's code objects -> {line: container of the step it calls}.
    self.lines: dict = {}

  def update_metric(self, typed_metric_name, value) -> None:
    step = self.step
    if step is None:
      step = self.locate()
      if step is None:
        self.touched = self.alert = True
        return
      self.learned = self.alert = True
    self.pending.append((step, typed_metric_name, value))

  def locate(self) -> Optional[MetricsContainer]:
    frame = sys._getframe(2)  # pylint: disable=protected-access
    lines = self.lines
    while frame is not None:
      by_line = lines.get(frame.f_code)
      if by_line is not None:
        return by_line.get(frame.f_lineno)
      frame = frame.f_back
    return None

  def current_state(self):
    # Asked for by code about to update the container itself: the update
    # goes to a throwaway one, and the harness does the element again.
    self.touched = self.alert = True
    return _ThrowawayState()

  def settle(self) -> None:
    """The held updates, into their steps' containers."""
    pending = self.pending
    count = len(pending)
    if count > 1:
      # An element's updates of one counter by one int (the load tests'
      # CounterOperation: the same counter ten times), as one: what the
      # cell's int64 sum of them would be.
      container, name, value = first = pending[0]
      if (type(value) is int and name.cell_type is CounterCell and  # pylint: disable=unidiomatic-typecheck
          pending.count(first) == count and abs(value) * count < _INT64):
        container.get_metric_cell(name).update(value * count)
        pending.clear()
        return
    for container, name, value in pending:
      container.get_metric_cell(name).update(value)
    pending.clear()

  def drop(self) -> None:
    """After a fallback: the element's updates are the harness's to make."""
    self.pending.clear()
    self.touched = self.alert = False


class _ThrowawayState:
  def __init__(self):
    self.metrics_container = MetricsContainer('fast path')
    self.name_context = None


class StepMetrics:
  """A container per step (transform id) for one task."""
  def __init__(self, transform_ids: list[str]):
    self.containers = {t: MetricsContainer(t) for t in transform_ids}

  @contextlib.contextmanager
  def scope(self, tracker: Tracker, transform_id: Optional[str]):
    """Updates made inside go to the step's container at once (bundle
    methods), or nowhere (``None``: DoFn set-up, which Beam runs before
    any bundle)."""
    saved = tracker.step
    tracker.step = self.containers.get(transform_id) if transform_id else (
        MetricsContainer('set-up'))
    try:
      yield
    finally:
      tracker.step = saved
      tracker.settle()

  def monitoring_infos(self) -> list:
    infos = []
    for transform_id, container in self.containers.items():
      infos.extend(
          container.to_runner_api_monitoring_infos(transform_id).values())
    return infos

