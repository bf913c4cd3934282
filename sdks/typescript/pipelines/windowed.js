"use strict";
// Windowed grouping with the window in context: "timestamp word" lines of
// a text file get their timestamps (seconds), go into fixed windows of
// --window_secs (default 10), or sessions with a gap of
// --sessions_gap_secs (merging windows), are grouped by word (GroupByKey),
// and a DoFn that reads each group's window from its context writes
// "[start, end) word count sorted-timestamps" lines to files OUTPUT-*.
//   node pipelines/windowed.js --job_endpoint=HOST:PORT --input=FILE \
//     --output=PREFIX [--window_secs=10 | --sessions_gap_secs=S] \
//     [--environment_type=...]
const Long = require("long");
const beam = require("apache-beam");
const pardo = require("apache-beam/transforms/pardo");
const windowings = require("apache-beam/transforms/windowings");
const { main } = require("../lib/runner");
const { readLines, writeLines } = require("../lib/files");

function parseEvent(line) {
  const [seconds, word] = line.trim().split(/\s+/);
  return { word: word, seconds: Number(seconds) };
}

// Long (Beam's Instant) reaches the workers as a value Beam registers for
// serialization; ts-closure-transform would write this __closure for a
// TypeScript pipeline.
function eventTime(event) {
  return Long.fromNumber(Math.round(event.seconds * 1000));
}
eventTime.__closure = () => ({ Long });

main((root, flags) => {
  root
    .apply(beam.create([flags.input]))
    .flatMap(readLines)
    .map(parseEvent)
    .apply(beam.assignTimestamps(eventTime))
    .apply(
      beam.windowInto(
        flags.sessions_gap_secs
          ? windowings.sessions(Number(flags.sessions_gap_secs))
          : windowings.fixedWindows(Number(flags.window_secs || 10))
      )
    )
    .apply(beam.groupBy((event) => event.word))
    .map(
      beam.withName("withWindow", function withWindow(group, context) {
        const window = context.window.lookup();
        const seconds = [...group.value].map((e) => e.seconds).sort((a, b) => a - b);
        return (
          "[" + window.start.toNumber() / 1000 + ", " + window.end.toNumber() / 1000 + ") " +
          group.key + " " + seconds.length + " " + seconds.join(",")
        );
      }),
      { window: pardo.windowParam() }
    )
    .apply(beam.parDo(writeLines(flags.output)));
});
