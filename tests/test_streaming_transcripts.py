"""Beam's trigger transcripts through a TestStream, on this runner.

Beam's ``trigger_test.TestStreamTranscriptTest`` turns each transcript of
``apache_beam/testing/data/trigger_transcripts.yaml`` (inputs, watermark
and processing-time advances, and the panes expected after each) into one
TestStream: every action is an event of its own, an ``expect`` event
carries the panes the events before it must have produced, and a stateful
``Check`` DoFn downstream of both the GroupByKey (and a CombinePerKey) and
the expectations compares them in order. So it passes only on a runner
that runs each TestStream event to quiescence (every wave, pane and timer
it causes) before the next, with Beam's panes: indexes, timestamps, early,
on-time and late flags. Beam's DirectRunner skips several
(``broken_on: SwitchingDirectRunner``); their expectations are the trigger
driver's own (``TriggerDriverTranscriptTest`` checks them without a
runner), and this runner passes them.

Each transcript is a streaming pipeline of a few dozen events: the ones
run here are those of the behaviours issue 31 named (early firings in
discarding mode, elements behind the watermark under OUTPUT_AT_EARLIEST,
lateness and garbage collection, sessions with early and late firings).
All 18 pass here (by hand: 13 transcripts and the 5 that must fail,
about 19 minutes at load 15-25), which is more than CI's budget.
"""
from apache_beam.transforms import trigger_test as beam_tt

from beam_suites import OnPySpark

RUN = [
    'test_discarding_early_fixed',  # early [1, 2], early [4, 5], on time [6]
    'test_known_late_data_watermark',  # OUTPUT_AT_EARLIEST behind it: 7
    'test_fixed_drop_late_data_after_allowed_lateness',
    'test_garbage_collection',
    'test_early_late_sessions',
]


class TestStreamTranscriptOnPySpark(OnPySpark,
                                    beam_tt.TestStreamTranscriptTest):
  pass


# The other transcripts of the file (defaults, timestamp combiners without
# late data, custom window timestamps, bad expectations), hidden: the
# unittest loader collects only callable test attributes.
for _name in dir(beam_tt.TestStreamTranscriptTest):
  if _name.startswith('test_') and _name not in RUN:
    setattr(TestStreamTranscriptOnPySpark, _name, None)
assert set(RUN) <= set(dir(beam_tt.TestStreamTranscriptTest)), RUN

del beam_tt
