"use strict";
// WordCount: the words of a text file counted, "word: count" lines written
// to files OUTPUT-*; user counters "lines" (non-empty) and "words".
//   node pipelines/wordcount.js --job_endpoint=HOST:PORT --input=FILE \
//     --output=PREFIX [--environment_type=LOOPBACK|PROCESS] [--environment_config=CMD]
const beam = require("apache-beam");
const pardo = require("apache-beam/transforms/pardo");
const { main } = require("../lib/runner");
const { readLines, writeLines } = require("../lib/files");

main((root, flags) => {
  root
    .apply(beam.create([flags.input]))
    .flatMap(readLines)
    .flatMap(
      beam.withName(
        "splitWords",
        pardo.withContext(
          function splitWords(line, context) {
            const words = line.split(/[^A-Za-z']+/).filter((word) => word.length > 0);
            context.words.increment(words.length);
            context.lines.increment(1);
            return words;
          },
          { words: pardo.counter("words"), lines: pardo.counter("lines") }
        )
      )
    )
    .apply(beam.countPerElement())
    .map(function format(wc) {
      return wc.element + ": " + wc.count;
    })
    .apply(beam.parDo(writeLines(flags.output)));
});
