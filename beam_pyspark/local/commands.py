"""``beam-pyspark local kafka|hdfs|s3|expansion-services``: one service in
the foreground for trying the docs (docs/local-services.md).

Each prints one line, once it serves, with its address and what a pipeline
pastes to use it, and stops on Ctrl-C (SIGINT) or SIGTERM with one line.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import tempfile
import threading

from beam_pyspark.local.expansion import ExpansionService
from beam_pyspark.local.kafka import KafkaBroker
from beam_pyspark.local.processes import ServiceError
from beam_pyspark.local.processes import log_tail
from beam_pyspark.local.stores import MiniHdfs
from beam_pyspark.local.stores import MotoS3

DIR_HELP = ('Where its data and log go (default: a new temporary directory, '
            'removed when it stops).')


def add_parser(sub) -> None:
  local = sub.add_parser(
      'local', help='Start a service the docs use, on this machine (from a '
      'clone of the repository): Kafka, HDFS, S3, expansion services.')
  which = local.add_subparsers(dest='service', required=True)
  p = which.add_parser('kafka', help='An Apache Kafka broker (one KRaft node; '
                       'its jars: make sdk-xlang).')
  p.add_argument('--port', type=int, default=9092,
                 help='Its bootstrap port (default 9092; 0: a free one).')
  p.add_argument('--topic', action='append', default=[],
                 metavar='NAME[:PARTITIONS]',
                 help='A topic to create at start; repeatable. Others are '
                 'created with one partition when first used.')
  p.add_argument('--dir', default=None, help=DIR_HELP)
  p = which.add_parser('hdfs', help='HDFS: Hadoop\'s MiniDFSCluster (its '
                       'jars: make hdfs-minicluster).')
  p.add_argument('--port', type=int, default=8020,
                 help='The NameNode\'s RPC port, of hdfs:// URLs (default '
                 '8020; 0: a free one).')
  p.add_argument('--http-port', type=int, default=9870,
                 help='The NameNode\'s HTTP port, WebHDFS (default 9870; 0: '
                 'a free one).')
  p.add_argument('--dir', default=None, help=DIR_HELP + ' Formatted anew at '
                 'every start.')
  p = which.add_parser('s3', help='An S3-compatible store: moto\'s server '
                       '(pip install \'moto[server]\' s3fs).')
  p.add_argument('--port', type=int, default=9000,
                 help='Its HTTP port (default 9000; 0: a free one).')
  p.add_argument('--dir', default=None, help=DIR_HELP + ' Objects live in '
                 'memory: gone when it stops.')
  p = which.add_parser(
      'expansion-services', help='Beam\'s Java expansion services for Beam '
      'SQL and KafkaIO (their jars: make sdk-xlang).')
  p.add_argument('--sql-port', type=int, default=8093,
                 help='Beam SQL\'s (default 8093; 0: a free one).')
  p.add_argument('--kafka-port', type=int, default=8094,
                 help='KafkaIO\'s (default 8094; 0: a free one).')
  p.add_argument('--dir', default=None, help='Where their logs go (default: '
                 'a new temporary directory, removed when they stop).')


def _kafka(args, directory: str, services: list) -> str:
  topics = []
  for spec in args.topic:
    name, _, partitions = spec.partition(':')
    if not name or not (partitions or '1').isdigit():
      raise ServiceError(f'--topic {spec!r}: give NAME or NAME:PARTITIONS')
    topics.append((name, int(partitions or 1)))
  broker = KafkaBroker(directory, port=args.port, auto_create_topics=True)
  services.append(broker)
  for name, partitions in topics:
    broker.create_topic(name, partitions)
  config = f'{{"bootstrap.servers": "{broker.bootstrap}"}}'
  made = ', '.join(f'{n}:{p}' for n, p in topics) or 'none yet'
  return (f'Kafka broker at {broker.bootstrap} (topics: {made}): '
          f'ReadFromKafka(consumer_config={config}, ...), '
          f'WriteToKafka(producer_config={config}, ...)')


def _hdfs(args, directory: str, services: list) -> str:
  hdfs = MiniHdfs(directory, args.port, args.http_port)
  services.append(hdfs)
  return (f'HDFS at hdfs://127.0.0.1:{hdfs.rpc_port}, WebHDFS at '
          f'127.0.0.1:{hdfs.http_port}: --checkpoint_location='
          f'{hdfs.url("checkpoints/my-job")} {" ".join(hdfs.options)}')


def _s3(args, directory: str, services: list) -> str:
  s3 = MotoS3(directory, args.port)
  services.append(s3)
  return (f'S3 store at {s3.endpoint}, bucket {s3.BUCKET}: '
          f'--checkpoint_location={s3.url("my-job")} {" ".join(s3.options)}')


def _expansion(args, directory: str, services: list) -> str:
  for name, port in (('sql', args.sql_port), ('kafka', args.kafka_port)):
    services.append(ExpansionService(name, directory, port=port, wait=False))
  for service in services:  # side by side: each JVM takes 5-30 s
    service.wait_ready()
  sql, kafka = (s.address for s in services)
  return (f'Expansion services: Beam SQL at {sql}, KafkaIO at {kafka}: '
          f'SqlTransform(..., expansion_service="{sql}"), '
          f'ReadFromKafka(..., expansion_service="{kafka}"), '
          f'WriteToKafka(..., expansion_service="{kafka}")')


STARTERS = {'kafka': (_kafka, 'the Kafka broker'), 'hdfs': (_hdfs, 'HDFS'),
            's3': (_s3, 'the S3 store'),
            'expansion-services': (_expansion, 'the expansion services')}


def run(args) -> int:
  """Starts ``args.service``, prints its line, serves until a signal."""
  start, what = STARTERS[args.service]
  prog = f'beam-pyspark local {args.service}'
  directory = args.dir or tempfile.mkdtemp(prefix='beam-pyspark-local-')
  services: list = []
  received: list[str] = []
  stopping = threading.Event()

  def on_signal(signum, _frame):
    received.append(signal.Signals(signum).name)
    stopping.set()
    # During start-up nothing waits on the event: leave the start there.
    raise KeyboardInterrupt

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, on_signal)
  code = 0
  try:
    try:
      line = start(args, directory, services)
    except ServiceError as exn:
      print(f'{prog}: {exn}', file=sys.stderr, flush=True)
      return 1
    print(f'{line}; Ctrl-C stops it', flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, lambda signum, _f: (
          received.append(signal.Signals(signum).name), stopping.set()))
    while not stopping.wait(0.5):
      ended = [s for s in services if s.process.poll() is not None]
      if ended:
        print(f'{prog}: {what} exited by itself with '
              f'{ended[0].process.returncode}; the end of its log '
              f'({ended[0].log_path}):\n{log_tail(ended[0].log_path)}',
              file=sys.stderr, flush=True)
        code = 1
        break
  except KeyboardInterrupt:
    pass
  finally:
    # Signals now wait for the stop instead of interrupting it.
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, signal.SIG_IGN)
    for service in services:
      with contextlib.suppress(Exception):
        service.stop()
    if not args.dir:
      shutil.rmtree(directory, ignore_errors=True)
  if received:
    print(f'{prog}: stopped {what} ({received[0]})', flush=True)
  return code
