"""Windowed counts of an unbounded source, written to files as each window
closes: a streaming Beam pipeline on Spark.

    python examples/streaming_counts.py --output /tmp/counts \\
        --runner=beam_pyspark.PySparkRunner --streaming \\
        [--seconds 60] [--rate 200] [--checkpoint_location DIR]

``PeriodicImpulse`` emits ``--rate`` events a second for ``--seconds``
(each a word from a small vocabulary, stamped with its event time); the
pipeline counts words per 10-second window and writes each window's counts
(``fileio.WriteToFiles``: a file per bundle that wrote to the window, so a
window's words may be split over a few) as the window closes: when the watermark
(the impulse's own, held back by what it has yet to emit) passes the
window's end. Stop it with Ctrl-C; run it again with the same
``--checkpoint_location`` to resume where it stopped.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms import window
from apache_beam.transforms.periodicsequence import PeriodicImpulse

WORDS = ['spark', 'beam', 'stream', 'window', 'watermark', 'trigger']


def word_of(timestamp) -> str:
  """A word chosen by the event's time (so a run is repeatable)."""
  return WORDS[int(float(timestamp) * 1000) % len(WORDS)]


def run(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--output', required=True,
                      help='Directory the per-window count files go to.')
  parser.add_argument('--seconds', type=float, default=60)
  parser.add_argument('--rate', type=float, default=200,
                      help='Events per second.')
  args, pipeline_args = parser.parse_known_args(argv)
  start = time.time()
  with beam.Pipeline(options=PipelineOptions(pipeline_args)) as p:
    _ = (
        p
        | PeriodicImpulse(start_timestamp=start,
                          stop_timestamp=start + args.seconds,
                          fire_interval=1.0 / args.rate)
        | beam.Map(word_of)
        | beam.WindowInto(window.FixedWindows(10))
        | beam.combiners.Count.PerElement()
        | beam.MapTuple(lambda word, count: f'{word}: {count}')
        | fileio.WriteToFiles(
            path=args.output, shards=1,
            file_naming=fileio.destination_prefix_naming('.txt')))


if __name__ == '__main__':
  logging.getLogger().setLevel(logging.INFO)
  try:
    run()
  except KeyboardInterrupt:
    # Ctrl-C: the runner stopped the job between micro-batches and said
    # where its checkpoint is kept.
    sys.exit(130)
