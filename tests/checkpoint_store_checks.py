"""What the checkpoint-storage tests share (tests/test_checkpoint_hdfs.py,
tests/test_checkpoint_s3.py): the store's guarantees, checked the same
way on each server. Not a test module."""

from __future__ import annotations

import uuid

import pytest

from beam_pyspark.errors import PipelineExecutionError
from beam_pyspark.spark.checkpoints import CheckpointDir
from beam_pyspark.storage import Location
from beam_pyspark.storage import checked
from beam_pyspark.storage import storage_options
from beam_pyspark.streaming.checkpoints import ManifestBook


def job_options(flags: list[str]) -> dict:
  """Pipeline flags as the Job API carries them."""
  found = {}
  for flag in flags:
    name, value = flag[2:].split('=', 1)
    found[f'beam:option:{name}:v1'] = value
  return found


def location(server, path: str) -> Location:
  return Location.parse(server.url(path),
                        storage_options(job_options(server.options)))


def check_store(server) -> None:
  """A store writes whole files, replaces on write, commits a name once,
  lists, removes and removes the whole location."""
  url = server.url(f'store-{uuid.uuid4().hex[:8]}')
  store = checked(url, storage_options(job_options(server.options))).store()
  assert store.isdir('')
  store.write('state/n/0/a', b'one')
  store.write('state/n/0/a', b'two')  # a write replaces
  assert store.read('state/n/0/a') == b'two'
  store.commit('manifests/0', b'first')
  with pytest.raises(FileExistsError):
    store.commit('manifests/0', b'a zombie driver\'s')
  assert store.read('manifests/0') == b'first'
  assert [n for n in store.listdir('manifests') if n.isdigit()] == ['0']
  # No temporary name is left behind.
  assert sorted(n for n in store.files('state')
                if not n.endswith('.keep')) == ['state/n/0/a']
  with pytest.raises(FileNotFoundError):
    store.read('state/n/0/missing')
  store.remove('state/n/0/a', 'state/n/0/missing')
  assert not store.exists('state/n/0/a')
  store.rmtree()
  assert not store.isdir('')


def check_checkpoint_dir(server) -> None:
  """A checkpoint there resumes from its manifests and sweeps the files
  of a batch that never committed."""
  where = location(server, f'dir-{uuid.uuid4().hex[:8]}')
  directory = CheckpointDir(where)
  book = ManifestBook('fp')
  book.changed(('state', 'n', 0), directory.write_file(0, b'zero'))
  directory.commit(book.commit(0, {'now': 5}))
  # A second driver on the same location (a zombie) cannot commit batch 0
  # over the first one's.
  with pytest.raises(PipelineExecutionError, match='another driver'):
    CheckpointDir(where).commit(ManifestBook('fp').commit(0, {'now': 6}))
  orphan = directory.write_file(1, b'never committed')
  again = CheckpointDir(where)
  manifests = again.manifests()
  assert [m.batch for m in manifests] == [0]
  resumed = ManifestBook('fp', manifests)
  again.sweep(resumed.live())
  assert again.read_file(resumed.file_of(('state', 'n', 0))) == b'zero'
  assert manifests[0].driver == {'now': 5}
  assert not where.store().exists(orphan)
  again.delete()
  assert not where.store().isdir('')
