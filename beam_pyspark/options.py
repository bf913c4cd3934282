"""Pipeline options of the runner.

The Spark master is Beam's own ``--spark_master_url`` (SparkRunnerOptions);
we add only what Beam lacks.
"""

from apache_beam.options.pipeline_options import PipelineOptions


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
