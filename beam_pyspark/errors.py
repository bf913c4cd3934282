"""Errors a user of the runner or the job server can act on."""

from __future__ import annotations


class BeamPySparkError(Exception):
  """Base class of the runner's own errors."""


class UnsupportedPipelineError(BeamPySparkError, ValueError):
  """The pipeline uses features this runner cannot execute.

  Raised before anything runs; lists every unsupported item at once.
  """
  def __init__(self, reasons: list[str]):
    self.reasons = list(reasons)
    super().__init__(
        'This pipeline cannot run on beam-pyspark:\n' +
        '\n'.join(f'  - {r}' for r in self.reasons) +
        '\nChange or remove these parts of the pipeline and submit again.')


class InvalidOptionsError(BeamPySparkError, ValueError):
  """Pipeline options the runner cannot take; lists every problem at once."""
  def __init__(self, problems: list[str]):
    self.problems = list(problems)
    super().__init__(
        'Invalid pipeline options for beam-pyspark:\n' +
        '\n'.join(f'  - {p}' for p in self.problems))


class PipelineExecutionError(BeamPySparkError, RuntimeError):
  """The pipeline failed while running; carries the user's traceback."""


class JobCancelledError(BeamPySparkError):
  """The job was cancelled while running."""
