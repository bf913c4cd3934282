"""The streaming engine's bookkeeping, sans-I/O: no Spark, no gRPC, no files.

What decides *when* things happen in a streaming Beam job lives here as
plain state machines fed with events, as Dask's ``WorkerState`` is, so each
rule is tested by feeding it events (tests/test_streaming_core.py):

- ``watermarks``: per-stage input and output watermarks with holds, by
  Prism's rules (``input = max(input, min(pending, upstream outputs))``,
  ``output = max(output, min(input, holds))``);
- ``timers``: pending timers per (transform, family, key, tag, window),
  due by event time against a stage's input watermark and by processing
  time against the batch's clock; their output timestamps hold the
  watermark. The batch engine drives the same table with both times at
  +inf once its input is exhausted;
- ``budget``: a trigger's record budget split evenly and absolutely over
  the endpoints (source shards) with backlog, as the streaming client of
  the design documents spreads its work budget.

Times are Beam's, in microseconds (``apache_beam.utils.timestamp``):
``MIN_MICROS`` is "nothing is known yet", ``MAX_MICROS`` "all input seen".
The Spark-facing parts (the Structured Streaming source, ``foreachBatch``)
live under ``spark/`` and call into these.
"""

# Beam's MIN_TIMESTAMP.micros and MAX_TIMESTAMP.micros, written out: the
# query's source (spark.microbatches) imports this package in Python
# processes of Spark's, where importing apache_beam would cost seconds
# before a job's first micro-batch (tests/test_streaming_core.py checks
# they are Beam's).
MIN_MICROS: int = -9223372036854775000
MAX_MICROS: int = 9223372036854775000
