"""Code that runs inside Spark executors (and in the driver for tests).

It knows nothing of Spark: a stage's input arrives as an iterator of
(input transform id, encoded bytes) and its output leaves the same way, so
the same bundle runner serves RDD partitions today and streaming
micro-batches tomorrow.
"""
