"""Spark's UI in Beam's words: job descriptions and call sites.

Spark names a job by its description (``spark.job.description``) and a
stage by the call site its last RDD was created at. PySpark sets that call
site to the first Python frame outside pyspark for every RDD it makes
(``SCCallSiteSync``), which for this runner reads
``partitionBy at .../beam_pyspark/spark/translate.py:364``. While the
runner builds a Beam stage's RDDs, ``call_site`` sets it to the stage's
label (planning.names.stage_label) and holds PySpark's own setting off, so
Spark's stages, its REST API and the status page name the same stages.
"""

from __future__ import annotations

import contextlib
import threading

_local = threading.local()


@contextlib.contextmanager
def call_site(sc, text: str):
  """RDDs made inside are created at ``text`` (Spark's stage names).

  Nested uses restore the outer text on leaving. PySpark sets its own call
  site only when its stack depth counter is 0; it is held above 0 here."""
  from pyspark.traceback_utils import SCCallSiteSync
  stack = getattr(_local, 'stack', None)
  if stack is None:
    stack = _local.stack = []
  stack.append(text)
  SCCallSiteSync._spark_stack_depth += 1  # pylint: disable=protected-access
  try:
    sc._jsc.setCallSite(text)  # pylint: disable=protected-access
    yield
  finally:
    stack.pop()
    SCCallSiteSync._spark_stack_depth -= 1  # pylint: disable=protected-access
    try:
      sc._jsc.setCallSite(stack[-1] if stack else None)  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      pass  # the context stopped: nothing left to name


@contextlib.contextmanager
def job_description(sc, text: str, restore: str, site: str = ''):
  """Spark jobs started inside are described as ``text`` (Spark's jobs
  page, its REST API's ``description``); ``restore`` afterwards. ``site``:
  the call site of RDDs PySpark makes inside (``call_site``), e.g. the one
  an action adds: else its stage reads "call at .../clientserver.py:644"
  on a streaming job's foreachBatch thread."""
  sc.setJobDescription(text[:MAX_DESCRIPTION])
  try:
    with call_site(sc, site) if site else contextlib.nullcontext():
      yield
  finally:
    try:
      sc.setJobDescription(restore)
    except Exception:  # pylint: disable=broad-except
      pass


# Spark's UI shows a description whole; keep it to a few lines.
MAX_DESCRIPTION = 600


def short(label: str) -> str:
  """'Beam stage 3' of 'Beam stage 3: Split, ...'."""
  return label.split(':', 1)[0]


def described(job: str, what: str, stages: list[str]) -> str:
  """A Spark job's description: the Beam job, what the Spark job is for,
  and the Beam stages it runs."""
  text = job + (f', {what}' if what else '')
  return text + (': ' + '; '.join(stages) if stages else '')


def shuffle_site(writers: list[str], group: str) -> str:
  """The call site of a shuffle's map side: the stages that write it."""
  return (', '.join(short(w) for w in writers) or 'Beam') + (
      f': {group} (shuffle write)')
