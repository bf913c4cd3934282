"""Code that runs inside Spark executors (and in the driver for tests).

It knows nothing of Spark: a stage's input arrives as an iterator of
(input transform id, encoded bytes) and its output leaves the same way, so
the same bundle runner serves RDD partitions today and streaming
micro-batches tomorrow.

- ``bundles``: one fused stage over one partition, bundle by bundle, with
  its residuals, timers (``streaming.timers``) and finalization;
- ``harnesses/``: the SDK harnesses bundles run on, one interface, chosen
  by environment URN, one cache per Python worker;
- ``state``, ``elements``, ``runtime``, ``reads``: the state servicer,
  element encoding, the job's decoded components, bounded-source splits;
- ``shuffle/``: the GroupByKey's records and spills, the reduce side's
  grouping and the paging of large groups to the harness;
- ``setup/``: the job's staged dependencies and log capture;
- ``inputs``: a stage's input read so that a failure of the stage feeding
  it in the same task fails the task, never passes for the input's end.
"""
