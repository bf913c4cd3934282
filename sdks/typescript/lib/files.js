"use strict";
// Reading and writing text files from DoFns.
//
// The TypeScript SDK's textio is a cross-language transform (Python's
// expansion service); these pipelines stay in one SDK. Every function below
// is shipped to the workers by serialize-closures, as source: it must not
// use this module's variables, so each one requires what it needs itself.

// Lines of the files whose paths are the elements.
function readLines(filePath) {
  const text = require("fs").readFileSync(filePath, "utf8");
  return text.split(/\r?\n/).filter((line) => line.length > 0);
}

// A DoFn writing each bundle's elements (strings) as the lines of one file,
// PREFIX-<random>; a job's output is every file with that prefix.
function writeLines(prefix) {
  return {
    beamName: "writeLines",
    prefix: prefix,
    // Written as `name: function`: serialize-closures ships a function's
    // source, and method shorthand (`startBundle() {}`) does not parse alone.
    startBundle: function () {
      this.lines = [];
    },
    process: function (line) {
      this.lines.push(line);
    },
    finishBundle: function () {
      if (this.lines.length > 0) {
        const name =
          this.prefix + "-" + require("crypto").randomBytes(8).toString("hex");
        require("fs").writeFileSync(name, this.lines.join("\n") + "\n");
      }
      this.lines = [];
    },
  };
}

module.exports = { readLines, writeLines };
