"""Job messages and Python logging levels, both ways."""

import logging

from apache_beam.portability.api import beam_job_api_pb2

PYTHON_LEVELS = {
    beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_DEBUG:
        logging.DEBUG,
    beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_DETAILED:
        logging.DEBUG,
    beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_BASIC:
        logging.INFO,
    beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_WARNING:
        logging.WARNING,
    beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_ERROR:
        logging.ERROR,
}


def importance_of(level: int) -> int:
  """The JobMessage importance of a Python logging level."""
  importance = beam_job_api_pb2.JobMessage.MessageImportance
  if level >= logging.ERROR:
    return importance.JOB_MESSAGE_ERROR
  if level >= logging.WARNING:
    return importance.JOB_MESSAGE_WARNING
  if level >= logging.INFO:
    return importance.JOB_MESSAGE_BASIC
  return importance.JOB_MESSAGE_DEBUG


def forwarded(level: int, text: str) -> tuple[int, str]:
  """(importance, text) of a log record forwarded from an executor or a
  harness to the job's messages.

  ERROR importance is the job's failure alone: the Job API's clients take
  an ERROR message for the job's error (Java's PortableRunner reports the
  first one, Python's the last), so a record logged at ERROR or above
  (a user's DoFn, a harness's gRPC warnings) comes as a WARNING that says
  its level.
  """
  importance = importance_of(level)
  if importance == beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_ERROR:
    return (beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_WARNING,
            f'[{logging.getLevelName(level)}] {text}')
  return importance, text


def to_python_logging(logger: logging.Logger):
  """A job's ``log(text, importance)`` into ``logger``, at the Python level
  of each message's importance (an engine run without a job's stream)."""
  def log(text: str, importance: int = (
      beam_job_api_pb2.JobMessage.MessageImportance.JOB_MESSAGE_BASIC)):
    logger.log(PYTHON_LEVELS.get(importance, logging.INFO), '%s', text)

  return log
