"""Whether a job runs over Spark Connect, and its session.

As PySpark itself decides: ``--spark_remote sc://...`` (the job server's
``--spark-remote``), else the ``SPARK_REMOTE`` environment variable, else
a Connect session the program already made (``SparkSession.builder
.remote(...)``, which sets ``SPARK_CONNECT_MODE_ENABLED``), else an
install of ``pyspark-client`` alone (no SparkContext to run on).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

_LOGGER = logging.getLogger(__name__)


def remote_url(remote: Optional[str]) -> Optional[str]:
  """The Connect endpoint a job runs on, '' for the program's own
  Connect session, None for the RDD engine (no pyspark import here: the
  engine is chosen before Spark is touched)."""
  if remote:
    return remote
  if os.environ.get('SPARK_REMOTE'):
    return os.environ['SPARK_REMOTE']
  if 'SPARK_CONNECT_MODE_ENABLED' in os.environ:
    return ''
  if 'pyspark' in sys.modules:
    from pyspark.util import is_remote_only
    if is_remote_only():
      return ''
  elif _client_only():
    return ''
  return None


def _client_only() -> bool:
  """pyspark-client alone: pyspark without its RDD core."""
  import importlib.util
  try:
    return (importlib.util.find_spec('pyspark') is not None and
            importlib.util.find_spec('pyspark.core') is None)
  except (ImportError, ValueError):
    return False


def connect_session(remote: Optional[str]):
  """The Connect session for ``remote`` (a URL, or '' for the program's
  own): the active or default one when it fits, else a new one."""
  from pyspark.sql.connect.session import SparkSession
  # pylint: disable=protected-access
  current = SparkSession.getActiveSession() or SparkSession._get_default_session()
  if current is not None and not remote:
    return current
  url = remote or os.environ.get('SPARK_REMOTE')
  if not url:
    if current is not None:
      return current
    raise ValueError(
        'No Spark Connect endpoint: pass --spark_remote sc://HOST:PORT '
        '(the job server: --spark-remote) or set SPARK_REMOTE.')
  session = SparkSession.builder.remote(url).getOrCreate()
  # A session of ours gives up on a lost server in seconds, not minutes
  # (connect.liveness); the program's own keeps the policy it chose.
  from beam_pyspark.connect.liveness import bound_retries
  bound_retries(session)
  _LOGGER.info('Connected to Spark %s at %s', session.version, url)
  return session
