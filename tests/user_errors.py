"""A user's own exception type, importable by executors and the driver."""


class InventoryError(Exception):
  """Raised by a test DoFn."""
