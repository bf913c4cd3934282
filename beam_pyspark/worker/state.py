"""Side-input state entries (built on the driver), per-task servicers, and
the backends that say where user state lives between tasks."""

from __future__ import annotations

import collections
import struct
from typing import Iterable
from typing import Iterator
from typing import MutableMapping
from typing import Optional
from typing import Protocol

import sortedcontainers

from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import execution
from apache_beam.runners.portability.fn_api_runner import worker_handlers

from beam_pyspark.planning.plan import SideInputSpec
from beam_pyspark.worker.shuffle import paging
from beam_pyspark.worker.runtime import JobRuntime

StateEntries = list[tuple[bytes, bytes]]  # (serialized StateKey, data)


def side_input_entries(
    runtime: JobRuntime, spec: SideInputSpec,
    chunks: Iterable[bytes]) -> StateEntries:
  """The state entries the harness asks for, for one side input.

  Iterable side inputs: one entry per encoded window.  Multimap side inputs:
  values per (window, key), the keys per window, and the key-values per
  window, as Beam's FnApiRunner serves them.
  """
  coder = runtime.coder(spec.coder_id)
  access = beam_runner_api_pb2.FunctionSpec(urn=spec.access_pattern)
  by_window = execution.WindowGroupingBuffer(access, coder)
  for chunk in chunks:
    by_window.append(chunk)
  entries: StateEntries = []
  if spec.access_pattern == common_urns.side_inputs.ITERABLE.urn:
    for _, window, data, _ in by_window.encoded_items():
      key = beam_fn_api_pb2.StateKey(
          iterable_side_input=beam_fn_api_pb2.StateKey.IterableSideInput(
              transform_id=spec.transform_id,
              side_input_id=spec.tag,
              window=window))
      entries.append((key.SerializeToString(), data))
  elif spec.access_pattern == common_urns.side_inputs.MULTIMAP.urn:
    for key, window, data, count in by_window.encoded_items():
      values_key = beam_fn_api_pb2.StateKey(
          multimap_side_input=beam_fn_api_pb2.StateKey.MultimapSideInput(
              transform_id=spec.transform_id,
              side_input_id=spec.tag,
              window=window,
              key=key))
      entries.append((values_key.SerializeToString(), data))
      keys_key = beam_fn_api_pb2.StateKey(
          multimap_keys_side_input=beam_fn_api_pb2.StateKey.
          MultimapKeysSideInput(
              transform_id=spec.transform_id,
              side_input_id=spec.tag,
              window=window))
      entries.append((keys_key.SerializeToString(), key))
      kvs_key = beam_fn_api_pb2.StateKey(
          multimap_keys_values_side_input=beam_fn_api_pb2.StateKey.
          MultimapKeysValuesSideInput(
              transform_id=spec.transform_id,
              side_input_id=spec.tag,
              window=window))
      entries.append(
          (kvs_key.SerializeToString(),
           key + struct.pack('>i', count) + data))
  else:
    raise ValueError(
        f'side input {spec.tag!r} of {spec.transform_id!r} uses access '
        f'pattern {spec.access_pattern}, which is not supported')
  return entries


class _Journaled(collections.defaultdict):
  """A defaultdict that, while ``journal`` is a dict, remembers what each
  key held when a bundle first touched it: (its value, its length), or
  (None, 0) for a key it did not have.

  Beam's servicer mutates state only in place (``self._state[key].append``,
  ``del self._state[key]``, ``SortedSet.add/remove``), so the first touch
  is enough to undo a bundle: truncate the list back, or put the old value
  back. Costs one dict lookup per access, and nothing when not journaling.
  """
  def __init__(self, factory, snapshot=None):
    super().__init__(factory)
    self.journal: Optional[dict] = None
    # How a value is saved on first touch: lists are truncated back on undo
    # (no copy); anything else (the ordered list's SortedSets) is copied.
    self._snapshot = snapshot

  def _record(self, key) -> None:
    journal = self.journal
    if journal is not None and key not in journal:
      if dict.__contains__(self, key):
        value = dict.__getitem__(self, key)
        journal[key] = (value, len(value) if self._snapshot is None
                        else self._snapshot(value))
      else:
        journal[key] = (None, 0)

  def __getitem__(self, key):
    self._record(key)
    return super().__getitem__(key)

  def __delitem__(self, key):
    self._record(key)
    super().__delitem__(key)

  def undo(self) -> None:
    journal, self.journal = self.journal or {}, None
    for key, (value, saved) in journal.items():
      if value is None:
        dict.pop(self, key, None)
      elif self._snapshot is None:
        del value[saved:]
        dict.__setitem__(self, key, value)
      else:
        dict.__setitem__(self, key, saved)


class TaskStateServicer(worker_handlers.StateServicer):
  """Beam's servicer, plus the pages of large groups (``worker.shuffle.paging``),
  and, if ``journaled`` (stateful stages), bundles whose state writes can
  be undone (``begin_bundle``). Other stages keep Beam's plain dicts: their
  side-input reads stay C-level lookups."""
  def __init__(self, journaled: bool = False):
    super().__init__()
    # Map (and set) user state: per (transform, state, window, key), the
    # map keys that hold values, in insertion order (Beam's servicer keeps
    # each map key's values, but cannot list the keys: Java's and Go's
    # MapState and SetState ask for them, multimap_keys_user_state).
    self._map_keys = collections.defaultdict(dict)
    if journaled:
      self._state = _Journaled(list)
      self._ordered_list_keys = _Journaled(
          sortedcontainers.SortedSet, snapshot=sortedcontainers.SortedSet)
      self._map_keys = _Journaled(dict, snapshot=dict)

  def begin_bundle(self) -> None:
    """From now on, remember how to undo this bundle's state writes."""
    with self._lock:
      self._state.journal = {}
      self._ordered_list_keys.journal = {}
      self._map_keys.journal = {}

  def commit_bundle(self) -> None:
    """Keeps the bundle's writes."""
    with self._lock:
      self._state.journal = None
      self._ordered_list_keys.journal = None
      self._map_keys.journal = None

  def rollback_bundle(self) -> None:
    """Undoes every state write since ``begin_bundle``: a bundle that failed
    and will run again must not see its own earlier writes twice."""
    with self._lock:
      self._state.undo()
      self._ordered_list_keys.undo()
      self._map_keys.undo()
      self._continuations.clear()

  def user_state(self) -> Iterator[tuple[bytes, list]]:
    """(serialized StateKey, chunks) of the user state held now."""
    with self._lock:
      for key, chunks in list(dict.items(self._state)):
        if chunks and _is_user_state(key):
          yield key, list(chunks)

  def load_user_state(self, entries: Iterable[tuple[bytes, list]]) -> None:
    """User state a task starts from (a state backend's)."""
    with self._lock:
      for key, chunks in entries:
        dict.__setitem__(self._state, key, list(chunks))
        state_key = beam_fn_api_pb2.StateKey.FromString(key)
        kind = state_key.WhichOneof('type')
        if kind == 'ordered_list_user_state':
          start = state_key.ordered_list_user_state.range.start
          state_key.ordered_list_user_state.ClearField('range')
          self._ordered_list_keys[state_key.SerializeToString()].add(start)
        elif kind == 'multimap_user_state':
          prefix, map_key = _map_key_of(state_key)
          self._map_keys[prefix][map_key] = None

  def get_raw(self, state_key, continuation_token=None):
    kind = state_key.WhichOneof('type')
    if kind == 'runner' and paging.is_paged_token(state_key.runner.key):
      return paging.read_page(state_key.runner.key, continuation_token)
    if kind == 'multimap_keys_user_state':
      # The map's keys: each as the SDK encoded it (nested), one after the
      # other, as the Fn API's concatenated data stream.
      with self._lock:
        keys = dict.get(self._map_keys, state_key.SerializeToString(), {})
        return b''.join(keys), None
    return super().get_raw(state_key, continuation_token)

  def append_raw(self, state_key, data):
    if state_key.WhichOneof('type') == 'multimap_user_state':
      prefix, map_key = _map_key_of(state_key)
      with self._lock:
        self._map_keys[prefix][map_key] = None
    return super().append_raw(state_key, data)

  def clear(self, state_key):
    kind = state_key.WhichOneof('type')
    if kind == 'multimap_user_state':
      prefix, map_key = _map_key_of(state_key)
      with self._lock:
        if dict.__contains__(self._map_keys, prefix):
          self._map_keys[prefix].pop(map_key, None)
    elif kind == 'multimap_keys_user_state':
      # The whole map: every key's values.
      prefix = state_key.SerializeToString()
      with self._lock:
        keys = list(dict.get(self._map_keys, prefix, {}))
        if keys:
          del self._map_keys[prefix]
      for map_key in keys:
        super().clear(_map_value_key(state_key, map_key))
      return _DONE
    return super().clear(state_key)


def task_state(entries: Iterable[StateEntries],
               journaled: bool = False) -> TaskStateServicer:
  """A fresh servicer for one task: side inputs loaded, user state empty."""
  servicer = TaskStateServicer(journaled)
  for entry_list in entries:
    for key, data in entry_list:
      servicer.append_raw(beam_fn_api_pb2.StateKey.FromString(key), data)
  return servicer


_DONE = worker_handlers._Future.done()  # pylint: disable=protected-access


def _map_key_of(state_key: beam_fn_api_pb2.StateKey) -> tuple[bytes, bytes]:
  """(the map's multimap_keys_user_state key, serialized; the map key)."""
  m = state_key.multimap_user_state
  return beam_fn_api_pb2.StateKey(
      multimap_keys_user_state=beam_fn_api_pb2.StateKey.MultimapKeysUserState(
          transform_id=m.transform_id, user_state_id=m.user_state_id,
          window=m.window, key=m.key)).SerializeToString(), m.map_key


def _map_value_key(keys_key: beam_fn_api_pb2.StateKey,
                   map_key: bytes) -> beam_fn_api_pb2.StateKey:
  m = keys_key.multimap_keys_user_state
  return beam_fn_api_pb2.StateKey(
      multimap_user_state=beam_fn_api_pb2.StateKey.MultimapUserState(
          transform_id=m.transform_id, user_state_id=m.user_state_id,
          window=m.window, key=m.key, map_key=map_key))


def _is_user_state(key: bytes) -> bool:
  return beam_fn_api_pb2.StateKey.FromString(key).WhichOneof('type') in (
      USER_STATE_TYPES)


# -- state backends ---------------------------------------------------------------

# The user-state kinds a stateful DoFn keeps between bundles (side inputs
# and the runner's own pages are the task's alone).
USER_STATE_TYPES = frozenset(
    ['bag_user_state', 'multimap_user_state', 'ordered_list_user_state'])


class StateBackend(Protocol):
  """Where a stage's user state lives between the tasks that use it.

  ``open`` gives a task its servicer (side inputs loaded, user state as the
  backend holds it); ``close`` hands it back once the task ended, with
  ``succeeded`` False for a failed task, whose writes are dropped.
  """
  def open(self, side_inputs: Iterable[StateEntries],
           journaled: bool) -> 'TaskStateServicer':
    ...

  def close(self, servicer: 'TaskStateServicer', succeeded: bool) -> None:
    ...


class PerTaskState:
  """Batch: a task's user state starts empty and ends with the task (each
  key's elements and timers are all in one task)."""
  def open(self, side_inputs, journaled):
    return task_state(side_inputs, journaled)

  def close(self, servicer, succeeded):
    pass


class StoredState:
  """User state kept between tasks in a mapping the caller owns (streaming:
  a key range's store, versioned by micro-batch), as serialized StateKey ->
  the list of its encoded chunks. A failed task leaves the store as it was.

  Loads and writes back the whole mapping; the streaming engine hands each
  task only the state of the keys its partition holds.
  """
  def __init__(self, store: MutableMapping[bytes, list]):
    self.store = store

  def open(self, side_inputs, journaled):
    servicer = task_state(side_inputs, journaled)
    servicer.load_user_state(self.store.items())
    return servicer

  def close(self, servicer, succeeded):
    if not succeeded:
      return
    user_state = dict(servicer.user_state())
    for key in [k for k in self.store if k not in user_state]:
      del self.store[key]
    self.store.update(user_state)
