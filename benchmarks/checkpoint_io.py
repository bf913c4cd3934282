"""What one micro-batch's checkpoint I/O costs through each candidate
file-system layer, on local disk (docs/checkpoint-storage.md).

    python -m benchmarks.checkpoint_io [--rounds 300] [--dir DIR]

One micro-batch's I/O, as the streaming engine does it: its tasks write
4 state files (a delta each, 2 KiB), the driver commits a manifest
(8 KiB: written whole, never replacing), the query's source lists the
manifests and reads the newest, and the driver removes the manifest and
the state files no kept manifest names. Layers: ``os`` calls (this
runner's LocalStore: fsync, rename; and the same calls without fsync),
fsspec's LocalFileSystem,
pyarrow.fs's LocalFileSystem and Beam's FileSystems (the last three
neither fsync nor refuse to replace: the cost of the layer alone).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid

STATE, MANIFEST = b'x' * 2048, b'm' * 8192


def _store_layer(root, options=None):
  from beam_pyspark.storage import Location
  store = Location.parse(root, options).store()

  def batch(n):
    names = [f'state/n/{p}/{uuid.uuid4().hex}' for p in range(4)]
    for name in names:
      store.write(name, STATE)
    store.commit(f'manifests/{n}', MANIFEST)
    latest = max(int(x) for x in store.listdir('manifests') if x.isdigit())
    store.read(f'manifests/{latest}')
    store.remove(f'manifests/{n}', *names)
  return batch


def _fsspec_layer(root):
  import fsspec
  fs = fsspec.filesystem('file')

  def write(path, data):
    tmp = f'{path}.tmp'
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    with fs.open(tmp, 'wb') as f:
      f.write(data)
    fs.mv(tmp, path)

  def batch(n):
    names = [f'{root}/state/n/{p}/{uuid.uuid4().hex}' for p in range(4)]
    for name in names:
      write(name, STATE)
    write(f'{root}/manifests/{n}', MANIFEST)
    latest = max(int(os.path.basename(x)) for x in fs.ls(
        f'{root}/manifests', detail=False) if os.path.basename(x).isdigit())
    fs.cat_file(f'{root}/manifests/{latest}')
    for name in [f'{root}/manifests/{n}', *names]:
      fs.rm_file(name)
  return batch


def _arrow_layer(root):
  from pyarrow import fs as pafs
  fs = pafs.LocalFileSystem()

  def write(path, data):
    tmp = f'{path}.tmp'
    fs.create_dir(os.path.dirname(path), recursive=True)
    with fs.open_output_stream(tmp) as f:
      f.write(data)
    fs.move(tmp, path)

  def batch(n):
    names = [f'{root}/state/n/{p}/{uuid.uuid4().hex}' for p in range(4)]
    for name in names:
      write(name, STATE)
    write(f'{root}/manifests/{n}', MANIFEST)
    infos = fs.get_file_info(pafs.FileSelector(f'{root}/manifests'))
    latest = max(int(i.base_name) for i in infos if i.base_name.isdigit())
    with fs.open_input_stream(f'{root}/manifests/{latest}') as f:
      f.read()
    for name in [f'{root}/manifests/{n}', *names]:
      fs.delete_file(name)
  return batch


def _beam_layer(root):
  from apache_beam.io.filesystems import FileSystems

  def write(path, data):
    tmp = f'{path}.tmp'
    FileSystems.mkdirs(os.path.dirname(path)) if not FileSystems.exists(
        os.path.dirname(path)) else None
    with FileSystems.create(tmp) as f:
      f.write(data)
    FileSystems.rename([tmp], [path])

  def batch(n):
    names = [f'{root}/state/n/{p}/{uuid.uuid4().hex}' for p in range(4)]
    for name in names:
      write(name, STATE)
    write(f'{root}/manifests/{n}', MANIFEST)
    found = FileSystems.match([f'{root}/manifests/*'])[0].metadata_list
    latest = max(int(os.path.basename(m.path)) for m in found
                 if os.path.basename(m.path).isdigit())
    with FileSystems.open(f'{root}/manifests/{latest}') as f:
      f.read()
    FileSystems.delete([f'{root}/manifests/{n}', *names])
  return batch


def _os_layer(root):
  def write(path, data):
    tmp = f'{path}.tmp'
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, 'wb') as f:
      f.write(data)
    os.replace(tmp, path)

  def batch(n):
    names = [f'{root}/state/n/{p}/{uuid.uuid4().hex}' for p in range(4)]
    for name in names:
      write(name, STATE)
    write(f'{root}/manifests/{n}', MANIFEST)
    latest = max(int(x) for x in os.listdir(f'{root}/manifests')
                 if x.isdigit())
    with open(f'{root}/manifests/{latest}', 'rb') as f:
      f.read()
    for name in [f'{root}/manifests/{n}', *names]:
      os.remove(name)
  return batch


LAYERS = {'os (LocalStore)': _store_layer, 'os, no fsync': _os_layer,
          'fsspec': _fsspec_layer,
          'pyarrow.fs': _arrow_layer, 'beam FileSystems': _beam_layer}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--rounds', type=int, default=300)
  parser.add_argument('--dir', default=None)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument(
      '--location', default=None,
      help='measure this runner\'s store alone at this URL (hdfs://, s3://)')
  parser.add_argument(
      '--option', action='append', default=[], metavar='NAME=VALUE',
      help='a storage option for --location (Beam\'s, e.g. hdfs_port=9870)')
  args = parser.parse_args(argv)
  if args.location:
    options = dict(o.split('=', 1) for o in args.option)
    times = []
    for _ in range(args.repeats):
      root = f'{args.location.rstrip("/")}/{uuid.uuid4().hex}'
      batch = _store_layer(root, options)
      batch(0)
      started = time.perf_counter()
      for n in range(1, args.rounds + 1):
        batch(n)
      times.append((time.perf_counter() - started) / args.rounds * 1000)
      from beam_pyspark.storage import Location
      Location.parse(root, options).store().rmtree()
    print(f'{args.location}: {statistics.median(times):.3f} ms per '
          f'micro-batch (runs: {", ".join(f"{t:.3f}" for t in times)})')
    return
  base = tempfile.mkdtemp(dir=args.dir, prefix='ckpt-io-')
  try:
    results = {name: [] for name in LAYERS}
    for _ in range(args.repeats):
      for name, make in LAYERS.items():
        root = os.path.join(base, uuid.uuid4().hex)
        os.makedirs(os.path.join(root, 'manifests'))
        batch = make(root)
        batch(0)  # warm (imports, first directories)
        started = time.perf_counter()
        for n in range(1, args.rounds + 1):
          batch(n)
        results[name].append(
            (time.perf_counter() - started) / args.rounds * 1000)
    for name, times in results.items():
      print(f'{name:18s} {statistics.median(times):7.3f} ms per micro-batch '
            f'(runs: {", ".join(f"{t:.3f}" for t in times)})')
  finally:
    shutil.rmtree(base, ignore_errors=True)


if __name__ == '__main__':
  main()
