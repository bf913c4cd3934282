"""The reduce side of GroupByKey: grouped encoded elements -> grouped output.

With the default windowing (global window, default trigger) grouping is
byte work: values stay encoded with the runner-safe coders and the output is
one on-time pane per key.  Any other windowing decodes with the SDK's data
channel coders and runs Beam's batch trigger driver per key, which gives
merging windows, custom windows, timestamp combiners and batch triggers.
"""

from __future__ import annotations

from typing import Iterable
from typing import Iterator

from apache_beam.transforms import trigger
from apache_beam.transforms import window
from apache_beam.utils import windowed_value

from beam_pyspark.planning.plan import GroupSpec
from beam_pyspark.worker.elements import decode_all
from beam_pyspark.worker.elements import encode_stream
from beam_pyspark.worker.runtime import JobRuntime

_ON_TIME_PANE = windowed_value.PaneInfo(
    is_first=True,
    is_last=True,
    timing=windowed_value.PaneInfoTiming.ON_TIME,
    index=0,
    nonspeculative_index=0)


def group_values(
    runtime: JobRuntime,
    spec: GroupSpec,
    grouped: Iterable[tuple[bytes, Iterable[bytes]]]) -> Iterator[bytes]:
  """``grouped``: (encoded key, encoded windowed KVs of that key)."""
  if spec.default_windowing:
    in_impl = runtime.coder_impl(spec.safe_input_coder_id)
    out_impl = runtime.coder_impl(spec.safe_output_coder_id)
    max_ts = window.GlobalWindow().max_timestamp()

    def outputs():
      for _, elements in grouped:
        key = None
        values = []
        for wv in decode_all(in_impl, elements):
          key = wv.value[0]
          values.append(wv.value[1])
        if values:
          yield window.GlobalWindows.windowed_value(
              (key, values), timestamp=max_ts, pane_info=_ON_TIME_PANE)

    return encode_stream(out_impl, outputs())

  in_impl = runtime.coder_impl(spec.input_coder_id)
  out_impl = runtime.coder_impl(spec.output_coder_id)
  windowing = runtime.windowing(spec.windowing_strategy_id)

  def windowed_outputs():
    driver = trigger.create_trigger_driver(windowing, is_batch=True)
    for _, elements in grouped:
      key = None
      values = []
      for wv in decode_all(in_impl, elements):
        key = wv.value[0]
        values.append(wv.with_value(wv.value[1]))
      if values:
        yield from driver.process_entire_key(key, values)

  return encode_stream(out_impl, windowed_outputs())
