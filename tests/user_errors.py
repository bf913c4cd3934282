"""A user's own exception type, importable by executors and the driver."""

import logging

# A user's module that logs when imported, as Beam's own GCP IO does
# ('apitools not found'): ``logging.warning`` gives a root logger with no
# handler Python's console handler. Imported in a Python worker when the
# job's functions are unpickled, after the worker silenced its console.
logging.warning('user_errors imported')


class InventoryError(Exception):
  """Raised by a test DoFn."""
