"""The command line: ``beam-pyspark job-server``, ``beam-pyspark local ...``.

Flags match Beam's Spark job server where one exists.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

# The job server forks (Spark's JVM launcher, PySpark's workers) while its
# gRPC servers run; gRPC's fork handlers then break the child now and then
# ("epoll_wait error: Bad file descriptor", the JVM gateway never comes
# up). Nothing here uses gRPC across a fork. Read when grpc is imported.
os.environ.setdefault('GRPC_ENABLE_FORK_SUPPORT', 'false')

# pylint: disable-next=wrong-import-position
from beam_pyspark.local import commands as local_commands


def _job_server_parser(sub) -> None:
  p = sub.add_parser(
      'job-server', help='Serve Beam\'s Job API, running jobs on Spark.')
  p.add_argument('--job-host', default='localhost')
  p.add_argument('--job-port', type=int, default=8099,
                 help='Job API port (0 picks a free one).')
  p.add_argument('--artifact-port', type=int, default=8098,
                 help='Artifact staging and retrieval port (0: free one).')
  p.add_argument('--expansion-port', type=int, default=8097,
                 help='Beam\'s Python expansion service port (0: free one; '
                 '-1: none).')
  p.add_argument('--fully-qualified-name-glob', '--fully_qualified_name_glob',
                 dest='fully_qualified_name_glob', default=None,
                 metavar='GLOB',
                 help='Python transforms the expansion service may construct '
                 'by fully qualified name (Beam\'s '
                 'beam:transforms:python:fully_qualified_named, as used by '
                 'Beam\'s expansion_service_main), e.g. "apache_beam.*" or '
                 '"mypackage.transforms.*". Default: none.')
  p.add_argument('--artifacts-dir', default=None,
                 help='Where staged artifacts and the job store live '
                 '(default ~/.beam-pyspark/artifacts).')
  p.add_argument('--spark-master-url', default='local[*]')
  p.add_argument('--spark-remote', default=None, metavar='sc://HOST:PORT',
                 help='Run every job over Spark Connect at this endpoint '
                 '(batch only; docs/spark-connect.md).')
  p.add_argument('--spark-conf', action='append', default=[],
                 metavar='KEY=VALUE', help='A Spark setting; repeatable.')
  p.add_argument('--max-invocation-history', type=int, default=10,
                 help='Ended jobs kept, with their messages and staged '
                 'artifacts (default 10); the oldest ended job goes first. '
                 'Preparations and running jobs do not count.')
  p.add_argument('--max-preparations', type=int, default=64,
                 help='Prepared jobs not run yet, at most (default 64): '
                 'past it Prepare is refused (RESOURCE_EXHAUSTED); a '
                 'preparation is never dropped for another.')
  p.add_argument('--max-preparations-per-client', type=int, default=None,
                 help='Prepared jobs not run yet that one client (one host, '
                 'as the server sees it: clients behind one proxy share it) '
                 'may keep (default: half of --max-preparations): past it '
                 'its Prepare is refused (RESOURCE_EXHAUSTED), so that one '
                 'client cannot take every slot.')
  p.add_argument('--preparation-timeout-secs', type=float, default=1800.0,
                 help='A preparation not run within this long ends FAILED '
                 '(default 1800 s).')
  p.add_argument('--job-store', default=None,
                 help='SQLite file of the job store (default: '
                 '<artifacts-dir>/jobs.sqlite).')
  p.add_argument('--status-port', type=int, default=8090,
                 help='The status page: jobs, their stages and messages '
                 '(on --job-host; 0 picks a free port; -1: none).')
  p.add_argument('--status-cancel', action=argparse.BooleanOptionalAction,
                 default=True,
                 help='Whether the status page\'s Cancel and Drain buttons '
                 'may cancel and drain jobs (as Flink\'s web.cancel.enable; '
                 'default: they may). '
                 '--no-status-cancel turns it off.')
  p.add_argument('--status-allowed-host', action='append', default=[],
                 metavar='NAME',
                 help='A host name the status page answers to besides its '
                 'own (localhost, this machine\'s names, --job-host, any IP '
                 'address): the name of a proxy or DNS alias in front of it; '
                 'repeatable; ".example.com" allows its subdomains, "*" any '
                 'name. Requests naming another host are refused (DNS '
                 'rebinding).')
  p.add_argument('--shutdown-grace-secs', type=float, default=20.0,
                 help='On SIGTERM or SIGINT: how long running batch jobs may '
                 'take to finish before they are cancelled (default 20 s: '
                 'Kubernetes sends SIGKILL 30 s after SIGTERM). Streaming jobs '
                 'stop at once, their checkpoints kept, and resume when the '
                 'server starts again on the same --artifacts-dir.')
  p.add_argument('--environment-override', action='append', default=[],
                 metavar='IMAGE_GLOB=SPEC',
                 help='Run Docker environments whose image matches IMAGE_GLOB '
                 'as SPEC: "process:COMMAND", "external:HOST:PORT", '
                 '"embedded" or "versioned" (Python images: another Beam '
                 'version than ours runs in a harness of its version, '
                 'installed from the package index into a cached virtualenv '
                 'on each executor); repeatable. A job\'s own '
                 '--environment_override comes first; Beam\'s own Java and Go '
                 'images boot with "python -m beam_pyspark.boot java|go", '
                 'Python images of our Beam version run embedded, and those '
                 'of another are refused unless one matches first.')
  p.add_argument('--spark-warm-up', action=argparse.BooleanOptionalAction,
                 default=True,
                 help='Start Spark (its SQL session and the streaming '
                 'source too) in the background when the server starts, so '
                 'that the first job does not wait 10-30 s for it (default); '
                 '--no-spark-warm-up starts it at the first job.')
  p.add_argument('--split-stragglers-after-secs', type=float, default=None,
                 metavar='SECS',
                 help='Split a bundle of a splittable read still running after '
                 'SECS and hand its rest to other tasks, for jobs that do not '
                 'set --split_stragglers_after_secs themselves (Java, Go and '
                 'TypeScript pipelines cannot); 0 turns splitting off '
                 '(default: the runner\'s, 10 s).')
  p.add_argument('--max-staging-buffer-bytes', type=int,
                 default=32 * 1024 * 1024,
                 help='Bytes of artifact chunks received but not yet written, '
                 'over all staging streams, at most (default 32 MiB).')
  p.add_argument('--artifact-url-allowlist', action='append', default=[],
                 metavar='PREFIX[,PREFIX]',
                 help='URL prefixes the server may fetch URL artifacts '
                 '(beam:artifact:type:url:v1) from, e.g. '
                 '"https://repo.example.com/jars,file:///opt/jars"; '
                 '"SCHEME://" allows every URL of a scheme; repeatable. '
                 'Default: none; a job naming another URL is refused at '
                 'Prepare (the server would fetch it from its own network).')
  p.add_argument('--max-artifact-bytes', type=int, default=4 << 30,
                 help='One staged artifact\'s size, at most (default 4 GiB): '
                 'a larger one is refused at staging. Executors stream each '
                 'file to disk, so this bounds disk, not memory.')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='beam-pyspark')
  sub = parser.add_subparsers(dest='command', required=True)
  _job_server_parser(sub)
  local_commands.add_parser(sub)
  args = parser.parse_args(argv)
  if args.command == 'local':
    return local_commands.run(args)
  # Here, not above: importing Beam logs warnings `local` has no use for.
  # pylint: disable-next=import-outside-toplevel
  from beam_pyspark.options import parse_conf
  # force: importing Beam already logged a warning through the root logger,
  # which gave it a handler at WARNING; the server's INFO lines need ours.
  logging.basicConfig(
      level=logging.INFO, format='%(asctime)s %(levelname)s %(name)s: %(message)s',
      force=True)
  logging.getLogger('py4j').setLevel(logging.WARNING)

  from beam_pyspark.jobservice.server import ArtifactsDirInUseError
  from beam_pyspark.jobservice.server import JobServer
  from beam_pyspark.jobservice.server import JobServerConfig
  from beam_pyspark.jobservice.server import PortInUseError
  from beam_pyspark.jobservice.server import UrlPolicy
  try:
    conf = parse_conf(args.spark_conf)
    UrlPolicy(args.artifact_url_allowlist)  # its entries, checked
  except Exception as exn:  # pylint: disable=broad-except
    parser.error(str(exn))
  try:
    server = JobServer(
        JobServerConfig(
            job_host=args.job_host,
            job_port=args.job_port,
            artifact_port=args.artifact_port,
            expansion_port=args.expansion_port,
            artifacts_dir=args.artifacts_dir,
            spark_master_url=args.spark_master_url,
            spark_remote=args.spark_remote,
            spark_conf=conf,
            max_invocation_history=args.max_invocation_history,
            max_preparations=args.max_preparations,
            max_preparations_per_client=args.max_preparations_per_client,
            preparation_timeout_secs=args.preparation_timeout_secs,
            job_store=args.job_store,
            max_staging_buffer_bytes=args.max_staging_buffer_bytes,
            max_artifact_bytes=args.max_artifact_bytes,
            fully_qualified_name_glob=args.fully_qualified_name_glob,
            status_port=args.status_port,
            status_cancel=args.status_cancel,
            status_allowed_hosts=list(args.status_allowed_host),
            environment_overrides=list(args.environment_override),
            spark_warm_up=args.spark_warm_up,
            split_stragglers_after_secs=args.split_stragglers_after_secs,
            artifact_url_allowlist=list(args.artifact_url_allowlist)))
  except (ArtifactsDirInUseError, PortInUseError) as exn:
    print(f'beam-pyspark job-server: {exn}', file=sys.stderr, flush=True)
    return 1
  server.start()
  print(f'Job service listening on {args.job_host}:{server.job_port}', flush=True)
  print(f'Artifact service listening on {args.job_host}:{server.artifact_port}',
        flush=True)
  if server.status_url:
    print(f'Status page at {server.status_url}', flush=True)
  if server.expansion_port:
    print(f'Expansion service listening on {args.job_host}:'
          f'{server.expansion_port}', flush=True)
  stop = threading.Event()
  received = []

  def on_signal(signum, _frame):
    received.append(signal.Signals(signum).name)
    stop.set()

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, on_signal)
  stop.wait()
  why = f'The job server is stopping ({received[0]})'
  print(f'{why}: streaming jobs stop now, to resume at its next start; other '
        f'running jobs may finish within {args.shutdown_grace_secs:g} s, then '
        'they are cancelled', flush=True)
  server.shutdown(args.shutdown_grace_secs, why)
  server.stop()
  return 0


if __name__ == '__main__':
  sys.exit(main())
