"use strict";
// How this package's pipelines are submitted: Beam's own PortableRunner
// (npm apache-beam 2.49.0) against a job endpoint, in LOOPBACK or PROCESS.
//
// LOOPBACK is the SDK's: the runner starts a worker pool in this program
// and the job's environment is EXTERNAL, pointing at it.
//
// PROCESS the 2.49.0 client cannot do itself: every environment that is not
// LOOPBACK becomes a DOCKER one, and packing it up runs
// `npm pack apache-beam@2_49_rc`, a tag the registry never had, so the
// submission fails before it reaches the job service. ProcessRunner does
// what the SDK would: it replaces the SDK's default environment
// ("js_default") by a beam:env:process:v1 one whose command starts the
// worker (for beam-pyspark: `python -m beam_pyspark.boot typescript`), and
// submits the rewritten proto through PortableRunner unchanged.
const childProcess = require("child_process");
const crypto = require("crypto");
const fs = require("fs");
const os = require("os");
const path = require("path");
// apache-beam's index first: its modules import each other in a cycle that
// only loading it from the top resolves.
require("apache-beam");
const { PortableRunner } = require("apache-beam/runners/portable_runner/runner");
const runnerApi = require("apache-beam/proto/beam_runner_api");
const environments = require("apache-beam/internal/environments");

// `--key=value` and `--key value` flags into {key: value}.
function parseFlags(argv) {
  const flags = {};
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (!arg.startsWith("--")) throw new Error("unexpected argument " + arg);
    const eq = arg.indexOf("=");
    if (eq >= 0) {
      flags[arg.slice(2, eq)] = arg.slice(eq + 1);
    } else if (i + 1 < argv.length && !argv[i + 1].startsWith("--")) {
      flags[arg.slice(2)] = argv[++i];
    } else {
      flags[arg.slice(2)] = "true";
    }
  }
  return flags;
}

// The directory holding this program's node_modules (apache-beam among
// them): a PROCESS worker on this machine runs the same apache-beam.
function nodeModulesDir() {
  const beamMain = require.resolve("apache-beam");
  return beamMain.slice(0, beamMain.lastIndexOf(path.sep + "apache-beam" + path.sep));
}

// `npm pack DIR` into a temporary directory (removed when this program
// exits: the job service has read it by then); the tarball's path.
function npmPack(dir) {
  const dest = fs.mkdtempSync(path.join(os.tmpdir(), "beam-pack-"));
  process.on("exit", () => fs.rmSync(dest, { recursive: true, force: true }));
  const done = childProcess.spawnSync(
    "npm", ["pack", "--pack-destination", dest, dir], { encoding: "utf8" }
  );
  if (done.status !== 0) {
    throw new Error("npm pack " + dir + " failed: " + done.stderr);
  }
  return path.join(dest, done.stdout.trim().split("\n").pop());
}

// A staged file as Beam's docker path stages npm packages: its role is
// beam:artifact:type:npm:v1 and its role payload the package's name.
function npmArtifact(tarball, name) {
  return runnerApi.ArtifactInformation.create({
    typeUrn: "beam:artifact:type:file:v1",
    typePayload: runnerApi.ArtifactFilePayload.toBinary({
      path: path.resolve(tarball),
      sha256: crypto.createHash("sha256").update(fs.readFileSync(tarball)).digest("hex"),
    }),
    roleUrn: "beam:artifact:type:npm:v1",
    rolePayload: new TextEncoder().encode(name),
  });
}

// The environment's npm packages, staged with the job: this program's
// package (the current directory's, as Beam's docker path packs it) and
// the apache-beam it runs (packed from its installed directory, so no
// registry is asked). The boot installs them on the executor.
function stagedPackages() {
  const pipelinePackage = JSON.parse(fs.readFileSync("package.json", "utf8"));
  return [
    npmArtifact(npmPack(path.join(nodeModulesDir(), "apache-beam")), "apache-beam"),
    npmArtifact(npmPack(process.cwd()), pipelinePackage.name),
  ];
}

// A PortableRunner that replaces the SDK's default environment
// ("js_default") by `replace(env)` before submitting the pipeline.
class EnvironmentRunner extends PortableRunner {
  constructor(options, replace) {
    super(options);
    this.replace = replace;
  }

  async runPipeline(pipeline, options) {
    pipeline = runnerApi.Pipeline.clone(pipeline);
    for (const [envId, env] of Object.entries(pipeline.components.environments)) {
      if (env.urn === environments.TYPESCRIPT_DEFAULT_ENVIRONMENT_URN) {
        pipeline.components.environments[envId] = this.replace(env);
      }
    }
    return this.runPipelineWithProto(pipeline, options);
  }
}

// PROCESS. command: the environment's command; env: its environment
// variables; dependencies: artifacts staged with it.
class ProcessRunner extends EnvironmentRunner {
  constructor(options, command, env = {}, dependencies = []) {
    super(options, (sdkEnv) => ({
      ...sdkEnv,
      urn: "beam:env:process:v1",
      payload: runnerApi.ProcessPayload.toBinary({ os: "", arch: "", command, env }),
      dependencies: [...sdkEnv.dependencies, ...dependencies],
    }));
  }
}

// DOCKER, as the SDK's own non-LOOPBACK path makes it (the image Beam
// publishes for the SDK, the pipeline's package and apache-beam staged as
// npm packages), less its `npm pack apache-beam@2_49_rc`. beam-pyspark's
// job server runs Beam's TypeScript image as a PROCESS environment booted
// by `python -m beam_pyspark.boot typescript` (its default override).
const SDK_IMAGE = "docker.io/apache/beam_typescript_sdk:2.49.0";
class DockerRunner extends EnvironmentRunner {
  constructor(options, image = SDK_IMAGE, dependencies = stagedPackages()) {
    super(options, (sdkEnv) => ({
      ...environments.asDockerEnvironment(sdkEnv, image),
      dependencies: [...sdkEnv.dependencies, ...dependencies],
    }));
  }
}

// The runner the flags ask for:
//   --job_endpoint=HOST:PORT
//   --environment_type=LOOPBACK (default) | PROCESS | DOCKER
//   --environment_config=COMMAND  (PROCESS: the command that boots a worker)
//   --stage_npm_packages  (PROCESS: stage this package and apache-beam for
//       the boot to install, instead of naming this node_modules)
//   --sdk_container_image=IMAGE  (DOCKER: default Beam's image for 2.49.0)
function createRunner(flags) {
  const options = {
    jobEndpoint: flags.job_endpoint,
    jobName: flags.job_name || "",
  };
  const type = (flags.environment_type || "LOOPBACK").toUpperCase();
  if (!options.jobEndpoint) throw new Error("--job_endpoint is required");
  if (type === "LOOPBACK") {
    return new PortableRunner({ ...options, environmentType: "LOOPBACK" });
  }
  if (type === "PROCESS") {
    if (!flags.environment_config) {
      throw new Error("--environment_type=PROCESS needs --environment_config=COMMAND");
    }
    if (flags.stage_npm_packages !== undefined && flags.stage_npm_packages !== "false") {
      return new ProcessRunner(options, flags.environment_config, {}, stagedPackages());
    }
    return new ProcessRunner(options, flags.environment_config, {
      BEAM_TYPESCRIPT_NODE_MODULES: nodeModulesDir(),
    });
  }
  if (type === "DOCKER") {
    return new DockerRunner(options, flags.sdk_container_image || SDK_IMAGE);
  }
  throw new Error("unsupported --environment_type " + type);
}

// Runs `build(root)` and exits: non-zero unless the job ends DONE. The
// SDK's worker pool (LOOPBACK) and gRPC channels would keep Node alive.
function main(build) {
  const flags = parseFlags(process.argv.slice(2));
  createRunner(flags)
    .run((root) => build(root, flags))
    .then(async (result) => {
      // The job's user counters, as the job service reports them (Beam's
      // distributions are left out: 2.49.0 encodes their payload as an
      // iterable, not as the model's four varints).
      console.log("Counters: " + JSON.stringify(await result.counters()));
      console.log("Pipeline DONE");
      process.exit(0);
    })
    .catch((e) => {
      console.error("Pipeline failed:", e);
      process.exit(1);
    });
}

module.exports = {
  parseFlags, createRunner, EnvironmentRunner, ProcessRunner, DockerRunner, main,
};
