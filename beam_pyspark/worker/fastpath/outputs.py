"""What the fast path's loop does with outputs of a type outside its plain
ones, as Beam's ``common._OutputHandler`` does with them, and its
per-window calls and window assignment (``codegen`` binds these)."""

from __future__ import annotations

from typing import Callable

from apache_beam.transforms.window import FixedWindows
from apache_beam.transforms.window import IntervalWindow
from apache_beam.utils.timestamp import MAX_TIMESTAMP
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import PANE_INFO_UNKNOWN

from beam_pyspark.worker.fastpath import chain as chains
from beam_pyspark.worker.fastpath.chain import Call


def slow(call: Call, meta: bool) -> Callable:
  """A step's slow path for an output ``y`` of an element in meta ``m``:
  ``[index,] value[, meta]`` as Beam's _OutputHandler would make them."""
  tags = call.tags or (None, )
  several = len(tags) > 1
  window_fn = call.window_fn
  stamped = (chains.TimestampedValue, chains.WindowedValue)

  if not meta and not several:
    def value_only(y, m):
      # Neither timestamps nor windows are read after this step: a
      # TimestampedValue or WindowedValue stands for its value.
      if isinstance(y, stamped):
        return y.value
      return slow(y, m)

  def slow(y, m):
    index = 0
    if isinstance(y, chains.TaggedOutput):
      tag = y.tag
      if not isinstance(tag, str):
        raise TypeError(f'In {call.step.name}, tag {tag} is not a string')
      if several:
        index = tags.index(tag) if tag in tags else -1
      elif tag != tags[0]:
        raise chains.SpecialOutput(f'an output to tag {tag!r}')
      y = y.value
    if isinstance(y, chains.WindowedValue):
      wv = y
      if len(m.windows) != 1:
        wv.windows *= len(m.windows)
    elif isinstance(y, chains.TimestampedValue):
      wv = chains.WindowedValue(
          y.value, y.timestamp,
          window_fn.assign(window_fn.AssignContext(y.timestamp, y.value)))
      if len(m.windows) != 1:
        wv.windows *= len(m.windows)
    else:
      wv = None
    if meta:
      value, meta_ = (wv.value, wv) if wv is not None else (y, m)
      return (index, value, meta_) if several else (value, meta_)
    value = wv.value if wv is not None else y
    return (index, value) if several else value

  return value_only if not meta and not several else slow


def assign(call: Call) -> Callable:
  """WindowInto: Beam's WindowIntoDoFn (bundle_processor), an element of
  one window at a time."""
  windowing = call.windowing
  window_fn = windowing.windowfn if windowing is not None else None
  if type(window_fn) is FixedWindows:  # pylint: disable=unidiomatic-typecheck
    return _assign_fixed(window_fn)

  def assign(x, m):
    if window_fn is None:  # WindowInto(GlobalWindows()) from the global
      if m.pane_info is PANE_INFO_UNKNOWN or m.pane_info == PANE_INFO_UNKNOWN:
        return m
      return chains.WindowedValue(x, m.timestamp, m.windows)
    if len(m.windows) != 1:
      raise chains.SpecialOutput('an element in several windows')
    windows = window_fn.assign(
        window_fn.AssignContext(m.timestamp, element=x, window=m.windows[0]))
    return chains.WindowedValue(x, m.timestamp, windows)

  return assign


def _assign_fixed(window_fn: FixedWindows) -> Callable:
  """Beam's ``FixedWindows.assign`` (start = t - (t - offset) % size) in
  integer microseconds, each window built once for the run of elements in
  it, rather than in ``Timestamp`` objects per element (a quarter of a
  streaming count's CPU)."""
  size, offset = window_fn.size.micros, window_fn.offset.micros
  last = [None, None]  # the last window's start, and (that window,)

  def assign(x, m):
    if len(m.windows) != 1:
      raise chains.SpecialOutput('an element in several windows')
    t = m.timestamp_micros
    start = t - (t - offset) % size
    if start != last[0]:
      last[1] = (fixed_window(start, size), )
      last[0] = start
    if m.pane_info is PANE_INFO_UNKNOWN:  # as Beam's: a new WindowedValue
      out = m.with_value(x)
      out.windows = last[1]
      return out
    return chains.WindowedValue(x, m.timestamp, last[1])

  return assign


def fixed_window(start: int, size: int) -> IntervalWindow:
  """The fixed window of ``size`` starting at ``start`` (microseconds)."""
  return _HashedWindow(Timestamp(micros=start), Timestamp(micros=start + size))


class _HashedWindow(IntervalWindow):
  """Beam's ``IntervalWindow``, its hash computed once: a precombine keys
  its accumulators by (window, key), and Beam's hash reads both bounds
  and ``MIN_TIMESTAMP``'s and ``MAX_TIMESTAMP``'s micros (Python
  properties) each time (a quarter of a fast-path count's loop). Equal to
  and hashing as the IntervalWindow of the same bounds, either way round
  (Python asks a subclass's ``__eq__`` first), and encoded as one."""
  def __init__(self, start, end):
    super().__init__(start, end)
    self._hash = IntervalWindow.__hash__(self)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    if not isinstance(other, IntervalWindow):
      return False
    return (self._hash == hash(other) and
            max(self._start_micros, _MIN) == max(other._start_micros, _MIN)
            and min(self._end_micros, _MAX) == min(other._end_micros, _MAX))

  def __ne__(self, other):
    return not self == other

  def __reduce__(self):  # pickled as Beam's own
    return IntervalWindow, (self.start, self.end)


_MIN, _MAX = MIN_TIMESTAMP.micros, MAX_TIMESTAMP.micros


def per_window(x, m):
  if len(m.windows) == 1:
    return (m, )
  return [chains.WindowedValue(x, m.timestamp, (w, )) for w in m.windows]


def user_window(window):
  """The window a DoFn's ``WindowParam`` gets: Beam's own
  ``IntervalWindow``, never the loop's ``_HashedWindow`` (a user may look
  at its type)."""
  if type(window) is _HashedWindow:  # pylint: disable=unidiomatic-typecheck
    return IntervalWindow(window.start, window.end)
  return window


def user_windowed_value(wv):
  """The WindowedValue a DoFn's ``WindowedValueParam`` gets (``wv`` a new
  one, from ``with_value``): after the loop's fixed-window assignment, the
  list of Beam's ``IntervalWindow`` that ``FixedWindows.assign`` returns
  (what Beam's WindowIntoDoFn leaves in a fused stage), not the loop's
  shared tuple of ``_HashedWindow``."""
  windows = wv.windows
  if windows and type(windows[0]) is _HashedWindow:  # pylint: disable=unidiomatic-typecheck
    wv.windows = [user_window(w) for w in windows]
  return wv


def bad_output(results):
  raise TypeError(
      'Returning a %s from a ParDo or FlatMap is not allowed. '
      'Please use list(%r) if you really want this behavior.' %
      (type(results).__name__, results))


def finish_output(call: Call) -> Callable:
  """Beam's _OutputHandler.finish_bundle_outputs, for one output."""
  tags = call.tags or (None, )

  def finish_output(item):
    tag = None
    if isinstance(item, chains.TaggedOutput):
      tag, item = item.tag, item.value
    if not isinstance(item, chains.WindowedValue):
      raise RuntimeError('Finish Bundle should only output WindowedValue '
                         f'type but got {type(item)}')
    if tag is None or tag == chains.MAIN_TAG:
      index = 0
    elif tag in tags:
      index = tags.index(tag)
    else:
      index = -1
    return index, item.value, item

  return finish_output
