"""The runner's options: declared once, converted once, typed.

Beam carries a job's options in two forms: ``PipelineOptions`` in the
submitting program (``PySparkRunner``) and a dict of ``beam:option:NAME:v1``
keys in the Job API (the job server). Both are turned into one
``RunnerOptions`` here, once per job, and that object is what the engine,
the Spark translation and the executors read; nothing else reads an option
by its key. The Spark master is Beam's own ``--spark_master_url``
(SparkRunnerOptions); ``PySparkRunnerOptions`` adds only what Beam lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import re
from typing import Any
from typing import Iterable
from typing import Optional
from typing import Union

from apache_beam.options.pipeline_options import PipelineOptions

from beam_pyspark.errors import BeamPySparkError
from beam_pyspark.redaction import redact

DEFAULT_SPLIT_AFTER_SECS = 10.0
# Streaming reads: a micro-batch's budget, and how long one restriction
# reads in it.
DEFAULT_RECORDS_PER_BATCH = 100_000
# How far the default budget grows while the reads are behind.
MAX_BUDGET_SCALE = 16
DEFAULT_READ_SECS = 1.0
DEFAULT_BUNDLE_BYTES = 32 << 20
# SparkRunnerOptions.spark_master_url's default in Beam.
BEAM_DEFAULT_MASTER = 'local[4]'


class PySparkRunnerOptions(PipelineOptions):
  @classmethod
  def _add_argparse_args(cls, parser):
    parser.add_argument(
        '--spark_conf',
        action='append',
        default=None,
        metavar='KEY=VALUE',
        help='A Spark setting passed to the SparkSession, e.g. '
        'spark.executor.memory=2g. Repeatable.')
    parser.add_argument(
        '--spark_remote',
        default=None,
        metavar='sc://HOST:PORT',
        help='Run the job over Spark Connect at this endpoint (the Connect '
        'engine, docs/spark-connect.md), as SPARK_REMOTE or a Connect '
        'session of the program would; batch only.')
    parser.add_argument(
        '--spark_parallelism',
        type=int,
        default=None,
        help='Partitions per shuffle and for spreading SDF work '
        '(default: the SparkContext\'s default parallelism).')
    parser.add_argument(
        '--drain',
        action='store_true',
        default=False,
        help='Run the job drained, as Beam drains a streaming job: splittable '
        'DoFns truncate their restrictions (their truncate_restriction, by '
        'default nothing left for unbounded ones), so reads that would never '
        'end stop after what they have claimed.')
    parser.add_argument(
        '--split_stragglers_after_secs',
        type=float,
        default=None,
        help='A bundle of a splittable DoFn that runs in its own harness '
        '(PROCESS, EXTERNAL, LOOPBACK) and is still running after this many '
        'seconds is asked for progress and split; the residual runs in '
        'another Spark task. 0 disables it (default: 10).')
    parser.add_argument(
        '--group_memory_mb',
        type=int,
        default=None,
        help='Memory a GroupByKey reduce task groups records in before it '
        'spills sorted runs to local disk (default: half of '
        'spark.python.worker.memory, which defaults to 512m).')
    parser.add_argument(
        '--status_port',
        type=int,
        default=None,
        help='Serve a status page for this program\'s jobs (states, stage '
        'graph, messages) on localhost at this port; 0 picks a free one, '
        'whose URL is logged (default: none). A job server has its own, '
        '--status-port.')
    parser.add_argument(
        '--progress',
        choices=('auto', 'log', 'off'),
        default=None,
        help='How this program shows its job\'s progress: auto (default) '
        'rewrites one line on stderr at most once a second when stderr is a '
        'terminal (stage, its transforms, Spark tasks, elements), else logs '
        'an INFO line every 30 s; log always logs; off shows nothing. A '
        'summary (state, duration, the largest counters) closes it.')
    parser.add_argument(
        '--checkpoint_location',
        default=None,
        help='Streaming: the directory where the job commits its state after '
        'every micro-batch, and from which a job started again with the same '
        'pipeline and this location resumes after a crash (as Spark '
        'Structured Streaming\'s checkpointLocation). A local path on local '
        'Spark; on a cluster shared storage, hdfs://, s3:// or gs:// (the '
        'extras beam-pyspark[hdfs], [s3], [gcs]; reached with Beam\'s '
        '--hdfs_* and --s3_* options). '
        'Default: a directory of the job\'s own under the temporary '
        'directory, removed when the job ends (so no resume).')
    parser.add_argument(
        '--checkpoint_store_timeout_secs',
        type=float,
        default=None,
        help='Streaming, a checkpoint on hdfs://, s3:// or gs://: the seconds '
        'a request to the store may go without an answer before it fails '
        '(S3: tried once more), and after which a call still waiting is '
        'reported in the job\'s messages, naming the store and what the '
        'job was writing or reading (default: 30).')
    parser.add_argument(
        '--max_records_per_batch',
        type=int,
        default=None,
        help='Streaming: the records the unbounded reads of one micro-batch '
        'may output, split evenly over the reads\' live restrictions with '
        'backlog (as Spark\'s maxOffsetsPerTrigger; 0: no limit; default: '
        f'{DEFAULT_RECORDS_PER_BATCH}, doubled after each micro-batch whose '
        f'reads had more to read, up to {MAX_BUDGET_SCALE} times, and shrunk '
        'back after those that had not).')
    parser.add_argument(
        '--max_bytes_per_batch',
        type=int,
        default=None,
        help='Streaming: the bytes (Beam\'s sampled sizes) the unbounded '
        'reads of one micro-batch may output, split evenly as the records '
        'are (default: 0, no limit).')
    parser.add_argument(
        '--max_read_secs',
        type=float,
        default=None,
        help='Streaming: how long one restriction of an unbounded read may '
        'run in a micro-batch before the runner checkpoints it (default: '
        f'{DEFAULT_READ_SECS}).')
    parser.add_argument(
        '--environment_override',
        action='append',
        default=None,
        metavar='IMAGE_GLOB=SPEC',
        help='Run the Docker environments whose image matches IMAGE_GLOB as '
        'SPEC instead: "process:COMMAND", "external:HOST:PORT", '
        '"embedded" or "versioned" (Python images; another Beam version than '
        'the runner\'s runs in a harness of its own version). Repeatable; '
        'before the job server\'s own and the defaults for Beam\'s images '
        '(Java and Go boot with "python -m beam_pyspark.boot java|go", '
        'Python of the runner\'s version runs embedded, of another is '
        'refused).')
    parser.add_argument(
        '--no_fast_path',
        action='store_true',
        default=False,
        help='Run every fused stage in Beam\'s SDK harness. By default a '
        'batch stage of the embedded Python environment whose DoFns, '
        'combines and windowing the loop can run (docs/design/fast-path.md) '
        'runs as a plain loop in the Python worker (the job\'s '
        'messages name the stages that did), with the harness as its '
        'fallback.')


# Beam's own option that this runner reads, next to ours.
_SPARK_MASTER_HELP = (
    'Spark master URL, e.g. local[4] or spark://HOST:7077 (Beam\'s '
    'SparkRunnerOptions). PySparkRunner: the user\'s running SparkContext, '
    'else local[*], when unset. The job server ignores it: every job runs on '
    'the server\'s own Spark application (its --spark-master-url).')

# Options a job server cannot honour per job, and why (said at Prepare).
JOB_SERVER_IGNORES = {
    'spark_master_url':
        'the job server runs every job on its own Spark application; start '
        'the server with --spark-master-url to choose the master',
    'spark_remote':
        'the job server runs every job where it was started; start it with '
        '--spark-remote sc://HOST:PORT to run its jobs over Spark Connect',
    'spark_conf':
        'Spark settings apply when a SparkContext starts, and the job '
        'server\'s is shared by all its jobs; start the server with '
        '--spark-conf KEY=VALUE instead',
    'status_port':
        'the job server serves one status page for all its jobs; its URL '
        'is printed when it starts (--status-port)',
    'progress':
        'a job server does not print its jobs\' progress; the job\'s '
        'messages name its status page and Spark UI',
}


def parse_level(value: Union[None, int, str], default: int = logging.INFO) -> int:
  """A logging level from Beam's ``--default_sdk_harness_log_level`` forms.

  Raises ValueError naming the accepted forms.
  """
  if value is None or value == '':
    return default
  if isinstance(value, int):
    return value
  text = str(value).strip()
  if text.lstrip('-').isdigit():
    return int(text)
  level = logging.getLevelName(text.upper())
  if isinstance(level, int):
    return level
  raise ValueError(
      f'Unknown log level {value!r}: use a level name (DEBUG, INFO, WARNING, '
      'ERROR, CRITICAL) or a number.')


def parse_conf(pairs: Optional[Iterable[str]]) -> dict:
  """``KEY=VALUE`` strings (from flags) into a dict, with a clear error."""
  conf = {}
  for pair in pairs or ():
    if '=' not in pair:
      raise BeamPySparkError(
          f'Spark setting {pair!r} is not of the form KEY=VALUE, '
          'e.g. spark.executor.memory=2g')
    key, value = pair.split('=', 1)
    conf[key.strip()] = value
  return conf


def _flag(value: Any) -> bool:
  return value in (True, 'true', 'True', 1, '1')


def _string_list(value: Any) -> list:
  """A repeatable option as the Job API carries it: a list, or one string."""
  if value in (None, ''):
    return []
  if isinstance(value, str):
    return [value]
  return [str(v) for v in value]


def _optional_int(value: Any) -> Optional[int]:
  return None if value in (None, '') else int(value)


def _read_budget(records: Optional[int], size: Optional[int],
                 secs: Any) -> dict:
  """RunnerOptions' streaming read budget from the three options (0 or
  less: no limit); raises ValueError for a time limit that is not > 0."""
  secs = DEFAULT_READ_SECS if secs in (None, '') else float(secs)
  if secs <= 0:
    raise ValueError(f'--max_read_secs={secs}: give a time above 0 seconds')
  return {
      'records_per_batch': (DEFAULT_RECORDS_PER_BATCH if records is None
                            else records if records > 0 else None),
      # The default budget grows while the reads have more to read.
      'adaptive_budget': records is None,
      'bytes_per_batch': size if size and size > 0 else None,
      'read_secs': secs,
  }


@dataclasses.dataclass
class RunnerOptions:
  """Everything the engine reads of a job's options, typed."""
  master: Optional[str] = None  # None: the active context, else local[*]
  # A Spark Connect endpoint (sc://...): the Connect engine runs the job.
  remote: Optional[str] = None
  conf: dict = dataclasses.field(default_factory=dict)
  parallelism: Optional[int] = None  # None: the context's parallelism
  # Plan the job drained (PySparkRunnerOptions.drain).
  drain: bool = False
  # Beam's --streaming.
  streaming: bool = False
  # Beam's --default_sdk_harness_log_level / --sdk_harness_log_level_overrides:
  # what executors forward of the logs written while stages run.
  log_level: int = logging.INFO
  log_overrides: Optional[dict] = None
  # 0: the runner never splits straggling splittable bundles.
  split_stragglers_after_secs: float = DEFAULT_SPLIT_AFTER_SECS
  # None: half of spark.python.worker.memory (spark.translate.group_budget).
  group_memory_mb: Optional[int] = None
  bundle_bytes: int = DEFAULT_BUNDLE_BYTES
  # PySparkRunner's own status page (None: none); job servers ignore it.
  status_port: Optional[int] = None
  # Streaming: where micro-batches commit (None: a per-job temporary one).
  checkpoint_location: Optional[str] = None
  # Streaming reads: a micro-batch's budget (None: no limit) and how long
  # one restriction may read in it.
  records_per_batch: Optional[int] = DEFAULT_RECORDS_PER_BATCH
  # The budget grows (up to MAX_BUDGET_SCALE times) while the reads leave
  # more than they were granted (--max_records_per_batch unset).
  adaptive_budget: bool = False
  bytes_per_batch: Optional[int] = None
  read_secs: float = DEFAULT_READ_SECS
  # PySparkRunner's progress in its program: 'auto', 'log' or 'off'.
  progress: str = 'auto'
  # Batch stages may skip the SDK harness (--no_fast_path, worker.fastpath).
  fast_path: bool = True
  # IMAGE_GLOB=SPEC mappings for Docker environments (planning.environments).
  environment_overrides: list = dataclasses.field(default_factory=list)
  # The job's pipeline options as the Job API carries them, handed as they
  # are to SDK harnesses that run in their own processes.
  job_options: Optional[dict] = None

  @classmethod
  def from_job_options(
      cls, options: dict, master: Optional[str] = None,
      conf: Optional[dict] = None,
      remote: Optional[str] = None) -> 'RunnerOptions':
    """From a job's options as the Job API carries them (``beam:option:NAME:v1``
    keys). ``master`` and ``conf`` are the job server's own: per-job ones
    are ignored (``JOB_SERVER_IGNORES``). Raises ValueError for a bad value.
    """
    def opt(name):
      return options.get(f'beam:option:{name}:v1')

    overrides = opt('sdk_harness_log_level_overrides')
    if isinstance(overrides, str):
      overrides = json.loads(overrides)
    split = opt('split_stragglers_after_secs')
    return cls(
        master=master,
        remote=remote,
        conf=dict(conf or {}),
        parallelism=_optional_int(opt('spark_parallelism')),
        drain=_flag(opt('drain')),
        streaming=_flag(opt('streaming')),
        log_level=parse_level(opt('default_sdk_harness_log_level')),
        log_overrides={k: parse_level(v) for k, v in (overrides or {}).items()}
        or None,
        split_stragglers_after_secs=(
            DEFAULT_SPLIT_AFTER_SECS if split in (None, '') else float(split)),
        group_memory_mb=_optional_int(opt('group_memory_mb')),
        checkpoint_location=opt('checkpoint_location') or None,
        **_read_budget(_optional_int(opt('max_records_per_batch')),
                       _optional_int(opt('max_bytes_per_batch')),
                       opt('max_read_secs')),
        fast_path=not _flag(opt('no_fast_path')),
        environment_overrides=cls.job_overrides(options),
        job_options=dict(options))

  @staticmethod
  def job_overrides(options: dict) -> list:
    """A job's --environment_override values, from its Job API options."""
    return _string_list(options.get('beam:option:environment_override:v1'))

  @classmethod
  def from_pipeline_options(cls, options: PipelineOptions) -> 'RunnerOptions':
    """From ``PipelineOptions``; the master only if it was set explicitly
    (Beam's default master must not replace a user's running Spark)."""
    from apache_beam.options import pipeline_options as po
    # Explicit: not Beam's default (get_all_options(drop_default=True)'s
    # test, without its 7 ms of parsing).
    master = options.view_as(po.SparkRunnerOptions).spark_master_url
    ours = options.view_as(PySparkRunnerOptions)
    worker = options.view_as(po.WorkerOptions)
    split = ours.split_stragglers_after_secs
    values = {name: _job_option_value(value) for name, value in
              options.get_all_options(retain_unknown_options=True).items()}
    return cls(
        master=None if master == BEAM_DEFAULT_MASTER else master,
        remote=ours.spark_remote or None,
        conf=parse_conf(ours.spark_conf),
        parallelism=ours.spark_parallelism,
        drain=bool(ours.drain),
        streaming=bool(options.view_as(po.StandardOptions).streaming),
        log_level=parse_level(worker.default_sdk_harness_log_level),
        log_overrides={
            name: parse_level(level) for name, level in
            (worker.sdk_harness_log_level_overrides or {}).items()} or None,
        split_stragglers_after_secs=(
            DEFAULT_SPLIT_AFTER_SECS if split is None else float(split)),
        group_memory_mb=ours.group_memory_mb,
        status_port=ours.status_port,
        progress=ours.progress or 'auto',
        checkpoint_location=ours.checkpoint_location or None,
        **_read_budget(ours.max_records_per_batch, ours.max_bytes_per_batch,
                       ours.max_read_secs),
        fast_path=not ours.no_fast_path,
        environment_overrides=list(ours.environment_override or ()),
        job_options={
            f'beam:option:{name}:v1': value
            for name, value in values.items() if value is not None})


def _job_option_value(value):
  """An option's value as Beam's PortableRunner sends it in a job: a
  ``ValueProvider`` (a templated pipeline's option) as its value when it has
  one, else left out; it is not JSON and no job's option."""
  from apache_beam.options.value_provider import ValueProvider
  if isinstance(value, ValueProvider):
    return value.get() if value.is_accessible() else None
  return value


# -- describing and checking options ------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptionInfo:
  name: str
  kind: str  # 'string', 'integer', 'number', 'boolean', 'array'
  description: str
  default: Any = None


def _kind(action: argparse.Action) -> str:
  if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # pylint: disable=protected-access
    return 'boolean'
  if isinstance(action, argparse._AppendAction):  # pylint: disable=protected-access
    return 'array'
  return {int: 'integer', float: 'number'}.get(action.type, 'string')


def runner_options() -> list[OptionInfo]:
  """Every option this runner reads, Beam's ``spark_master_url`` first."""
  parser = argparse.ArgumentParser(add_help=False)
  PySparkRunnerOptions._add_argparse_args(parser)  # pylint: disable=protected-access
  infos = [OptionInfo('spark_master_url', 'string', _SPARK_MASTER_HELP)]
  for action in parser._actions:  # pylint: disable=protected-access
    infos.append(
        OptionInfo(action.dest, _kind(action), action.help or '',
                   action.default))
  return infos


def misspelled_options(names: Iterable[str]) -> list[str]:
  """For option names that look like a misspelling of one of ours, what to
  write instead. Beam drops an option it does not know with a warning only,
  so ``--spark_master=...`` would run the job on the default master."""
  ours = [info.name for info in runner_options()]
  problems = []
  for name in names:
    if name in ours:
      continue
    normal = name.lstrip('-').replace('-', '_').lower()
    close = ([normal] if normal in ours else
             difflib.get_close_matches(normal, ours, n=1, cutoff=0.8))
    if not close and normal.startswith('spark'):
      close = [o for o in ours if o.startswith(normal) or normal.startswith(o)]
    if close:
      problems.append(
          f'--{name} is not an option of this runner (Beam would silently '
          f'drop it): did you mean --{close[0]}?')
  return problems


def unknown_option_names(options: PipelineOptions) -> list[str]:
  """Names given on the command line that no registered option declares.

  Read from the flags as given: Beam's own parse of unknown options turns
  ``--spark-master-url`` into ``spark_master_url``, hiding that the flag
  itself was dropped.
  """
  known = options.get_all_options()
  names = []
  for flag in getattr(options, '_flags', None) or ():
    if not flag.startswith('--'):
      continue
    name = flag[2:].split('=', 1)[0]
    if name and name not in known:
      names.append(name)
  return names


def ignored_by_job_server(job_options: dict, server_master: str) -> list[str]:
  """Which of a job's options a job server does not honour, and why."""
  notes = []
  for name, why in JOB_SERVER_IGNORES.items():
    value = job_options.get(f'beam:option:{name}:v1')
    if value in (None, '', []):
      continue
    # Beam's client sends every option with its default, and Beam's
    # default master (local[4]) says nothing about what the user wanted.
    if name == 'spark_master_url' and value in (server_master,
                                                 BEAM_DEFAULT_MASTER):
      continue
    if name == 'progress' and value == 'auto':  # the default, said by all
      continue
    notes.append(f'--{name}={redact(name, value)} is ignored: {why}.')
  return notes


def program_job_name(argv0: str) -> Optional[str]:
  """A job's name when the user gave no ``--job_name``: its program's
  ('wordcount' for ``python wordcount.py``), as Spark names an application
  and Beam's Java SDK its jobs by their main class; None where there is no
  program to name (``python -c``, a notebook)."""
  name = os.path.splitext(os.path.basename(argv0 or ''))[0]
  if not re.fullmatch(r'[A-Za-z0-9][\w.-]{0,62}', name) or name in (
      '__main__', 'ipykernel_launcher'):
    return None
  return name


def job_name(job_options: Optional[dict]) -> Optional[str]:
  """The user's ``--job_name``, from a job's options in Job API form (Beam's
  Python client always sends ``job_name='job'`` in PrepareJobRequest)."""
  return (job_options or {}).get('beam:option:job_name:v1') or None
