"""A keyed partition's state chain on disk (worker.statestore): what a
wave writes, what a Python worker's cache saves, and the error when a
file is missing."""

from __future__ import annotations

import os
import pickle

import pytest

from beam_pyspark.streaming import statestore
from beam_pyspark.worker import statestore as store_io


def _records(root, chain):
  records = []
  for name in chain:
    with open(os.path.join(root, name), 'rb') as f:
      records.append(pickle.load(f))
  return records


def test_a_wave_writes_a_delta_of_the_keys_it_touched(tmp_path):
  root = str(tmp_path)
  first = store_io.PartitionStore(root, 'job-a', 'gbk:x', 0, None)
  assert first.load() == ({}, None)
  chain = first.save({f'k{i}'.encode(): b'v' for i in range(100)}, 'objs')
  assert len(chain) == 1
  second = store_io.PartitionStore(root, 'job-a', 'gbk:x', 0, chain)
  entries, decoded = second.load()
  assert decoded == 'objs', 'the chain this worker wrote is still cached'
  entries[b'k3'] = b'changed'
  del entries[b'k4']
  chain = second.save(entries, 'objs2')
  assert len(chain) == 2
  delta = _records(root, chain)[1]
  assert delta.kind == statestore.DELTA
  assert delta.upserts == {b'k3': b'changed'} and delta.deletes == (b'k4',)
  # Another worker (an empty cache) reads the chain from its files.
  store_io.release('job-a')
  third = store_io.PartitionStore(root, 'job-a', 'gbk:x', 0, chain)
  entries, decoded = third.load()
  assert decoded is None and len(entries) == 99
  assert entries[b'k3'] == b'changed' and b'k4' not in entries
  # Nothing changed: nothing written, the same chain.
  assert third.save(entries) == chain
  assert store_io.PartitionStore(root, 'job-a', 'gbk:x', 0, chain).save(
      {}) is None


def test_a_task_that_fails_leaves_the_cache_without_its_state(tmp_path):
  root = str(tmp_path)
  chain = store_io.PartitionStore(root, 'job-b', 'n', 1, None).save(
      {b'k': b'1'}, ['mutable'])
  failed = store_io.PartitionStore(root, 'job-b', 'n', 1, chain)
  _, decoded = failed.load()
  decoded.append('half done')  # the task dies before save()
  retry = store_io.PartitionStore(root, 'job-b', 'n', 1, chain)
  assert retry.load() == ({b'k': b'1'}, None)


def test_a_missing_state_file_names_the_checkpoint_location(tmp_path):
  # No committed micro-batch there at all: removed, or not seen here.
  with pytest.raises(RuntimeError, match='--checkpoint_location') as info:
    store_io.PartitionStore(str(tmp_path), 'job-c', 'n', 0,
                            ('state/none/0/gone',)).load()
  assert 'removed while the job ran' in str(info.value)
  # Commits are there, one state file is not: every executor must see it.
  (tmp_path / 'manifests').mkdir()
  with pytest.raises(RuntimeError, match='--checkpoint_location') as info:
    store_io.PartitionStore(str(tmp_path), 'job-d', 'n', 0,
                            ('state/none/0/gone',)).load()
  assert 'every executor must see' in str(info.value)
