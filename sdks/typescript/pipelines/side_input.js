"use strict";
// Side inputs: the words of a text file, less those of a stop-word file (an
// iterable side input), each marked "long" or "short" against the mean
// length of all the words (a singleton side input computed from the main
// input itself). Lines "word length long|short" go to files OUTPUT-*.
//   node pipelines/side_input.js --job_endpoint=HOST:PORT --input=FILE \
//     --stopwords=FILE --output=PREFIX [--environment_type=...]
const beam = require("apache-beam");
const combiners = require("apache-beam/transforms/combiners");
const pardo = require("apache-beam/transforms/pardo");
const { main } = require("../lib/runner");
const { readLines, writeLines } = require("../lib/files");

function splitWords(line) {
  return line.split(/[^A-Za-z']+/).filter((word) => word.length > 0);
}

main((root, flags) => {
  const words = root
    .apply(beam.withName("input", beam.create([flags.input])))
    .flatMap(beam.withName("readInput", readLines))
    .flatMap(splitWords);
  const stopwords = root
    .apply(beam.withName("stopwords", beam.create([flags.stopwords])))
    .flatMap(beam.withName("readStopwords", readLines));
  const meanLength = words.apply(
    beam.groupGlobally().combining((w) => w.length, combiners.mean, "mean")
  );
  words
    .apply(
      beam.parDo(
        {
          beamName: "markWords",
          process: function (word, context) {
            // apache-beam 2.49.0 hands every lookup() of an iterable side
            // input in the global window the same generator, so only the
            // first element would see its values: read it once per DoFn
            // instance (the global window's side input never changes).
            if (this.stop === undefined) {
              this.stop = new Set(context.stopwords.lookup());
            }
            if (this.stop.has(word)) return [];
            const mean = context.meanLength.lookup().mean;
            return [word + " " + word.length + " " + (word.length > mean ? "long" : "short")];
          },
        },
        {
          stopwords: pardo.iterableSideInput(stopwords),
          meanLength: pardo.singletonSideInput(meanLength),
        }
      )
    )
    .apply(beam.parDo(writeLines(flags.output)));
});
