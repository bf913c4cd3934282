"""A Spark Connect server that is gone fails the job in seconds.

PySpark's Connect client retries an unreachable server (gRPC
UNAVAILABLE) with its DefaultPolicy: 15 retries, backoff growing 4x to a
minute, over ten minutes; and a reattachable execution whose server
vanished is retried again (``RetryException``) for up to an hour
(pyspark/sql/connect/client/retries.py). A job whose server was killed
sat silent for five minutes and more. A batch job has nothing to wait
for once its server is gone: its Spark jobs, cached frames and Python
workers went with it. So the sessions the engine runs on retry for
about 20 s (enough for a server's brief hiccup, or a load balancer's
failover), and a failure while the endpoint refuses connections names
the endpoint.
"""

from __future__ import annotations

import logging
import socket
from typing import Optional

_LOGGER = logging.getLogger(__name__)

# Backoffs of 0.05, 0.2, 0.8, 3.2 then 4 s (plus PySpark's jitter of up to
# 0.5 s past 2 s): about 20 s of retries in all.
RETRY_POLICY = {
    'max_retries': 8,
    'initial_backoff': 50,
    'backoff_multiplier': 4.0,
    'max_backoff': 4000,
}
# A reattachable execution's own retries (RetryException), in seconds.
MAX_REATTACH_SECS = 30.0


def bound_retries(session) -> None:
  """``session``'s client gives up on an unreachable server in ~20 s."""
  client = session.client
  try:
    from pyspark.sql.connect.client.retries import DefaultPolicy
    client.set_retry_policies([DefaultPolicy(**RETRY_POLICY)])
    # pylint: disable=protected-access
    if hasattr(client, '_max_retry_exception_elapsed_time'):
      client._max_retry_exception_elapsed_time = MAX_REATTACH_SECS
  except Exception:  # pylint: disable=broad-except
    # A client of another version keeps its own policy; a lost server
    # still fails the job, later.
    _LOGGER.debug('Could not bound the Connect client\'s retries',
                  exc_info=True)


def endpoint(session) -> tuple[str, Optional[str], Optional[int]]:
  """The session's endpoint: its URL as a user wrote it (sc://HOST:PORT),
  host and port."""
  builder = getattr(session.client, '_builder', None)
  url = getattr(builder, 'url', None)
  host = getattr(url, 'hostname', None)
  try:
    port = getattr(builder, '_port', None) or (url.port if url else None)
  except ValueError:
    port = None
  shown = f'sc://{host}:{port}' if host else 'the Spark Connect endpoint'
  return shown, host, port


def unreachable(session, timeout: float = 3.0) -> Optional[str]:
  """Why the session's server cannot be reached (a refused or timed-out
  TCP connection to its endpoint), or None if it answers."""
  shown, host, port = endpoint(session)
  if not host or not port:
    return None
  try:
    socket.create_connection((host, port), timeout).close()
    return None
  except OSError as exn:
    return f'{shown}: {exn.strerror or exn}'


def lost_server_message(session, error: BaseException) -> Optional[str]:
  """For a failure while the server is unreachable: what happened and
  what to do; None when the server still answers."""
  why = unreachable(session)
  if why is None:
    return None
  last = _rpc_error(error)
  return (
      f'Lost the Spark Connect server at {why}. The job failed with it '
      '(its Spark jobs and cached data were on that server): check that '
      'the server runs and is reachable from here (--spark_remote / '
      'SPARK_REMOTE), then run the job again.'
      + (f'\nThe client\'s last error: {last}' if last else ''))


def _rpc_error(error: Optional[BaseException]) -> str:
  """The gRPC status behind ``error`` (its cause chain), in a line."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    code, details = getattr(error, 'code', None), getattr(error, 'details', None)
    if callable(code) and callable(details):
      try:
        return f'{code().name}: {details()}'[:500]
      except Exception:  # pylint: disable=broad-except
        pass
    error = error.__cause__ or error.__context__
  return ''


def abandon(session) -> None:
  """Closes the session of a server that is gone, at once: the calls
  its client still makes in the background (ReleaseExecute, each retried
  for ~20 s, which the interpreter waits for at exit) fail instead of
  retrying, and the next job opens a new session (the old one's state
  died with its server)."""
  # pylint: disable=protected-access
  try:
    session.client._channel.close()
  except Exception:  # pylint: disable=broad-except
    _LOGGER.debug('Could not close the Connect channel', exc_info=True)
  try:
    session.stop()
  except Exception:  # pylint: disable=broad-except
    _LOGGER.debug('Could not stop the Connect session', exc_info=True)
