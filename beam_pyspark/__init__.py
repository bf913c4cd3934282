"""beam-pyspark: run Apache Beam pipelines on Apache Spark through PySpark.

Use ``--runner=beam_pyspark.PySparkRunner``.
"""

__version__ = '0.1.0'


def __getattr__(name):
  # Lazy, so that importing a subpackage (e.g. planning) pulls in no Spark.
  if name == 'PySparkRunner':
    from beam_pyspark.runner import PySparkRunner
    return PySparkRunner
  raise AttributeError(name)


__all__ = ['PySparkRunner']
