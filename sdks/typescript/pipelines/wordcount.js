"use strict";
// WordCount: the words of a text file counted, "word: count" lines written
// to files OUTPUT-*.
//   node pipelines/wordcount.js --job_endpoint=HOST:PORT --input=FILE \
//     --output=PREFIX [--environment_type=LOOPBACK|PROCESS] [--environment_config=CMD]
const beam = require("apache-beam");
const { main } = require("../lib/runner");
const { readLines, writeLines } = require("../lib/files");

main((root, flags) => {
  root
    .apply(beam.create([flags.input]))
    .flatMap(readLines)
    .flatMap(function splitWords(line) {
      return line.split(/[^A-Za-z']+/).filter((word) => word.length > 0);
    })
    .apply(beam.countPerElement())
    .map(function format(wc) {
      return wc.element + ": " + wc.count;
    })
    .apply(beam.parDo(writeLines(flags.output)));
});
