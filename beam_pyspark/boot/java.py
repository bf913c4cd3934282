"""Boot of Beam's Java SDK harness for PROCESS environments.

    --defaultEnvironmentType=PROCESS
    --defaultEnvironmentConfig={"command": "python -m beam_pyspark.boot java"}

does what Beam's Java container does (``sdks/java/container/boot.go``):
the job's options and the environment's staged jars come from the runner's
provision and artifact services (``boot.common``); the JVM then runs
``org.apache.beam.fn.harness.FnHarness`` with the environment variables
FnHarness reads (``HARNESS_ID``, ``CONTROL_API_SERVICE_DESCRIPTOR``,
``LOGGING_API_SERVICE_DESCRIPTOR``, ``STATUS_API_SERVICE_DESCRIPTOR``,
``PIPELINE_OPTIONS_FILE``, ``RUNNER_CAPABILITIES``; ``PIPELINE_OPTIONS``
too for a harness older than Beam 2.50, which reads only that).

Where the harness's classes come from. Beam's container puts its own
``beam-sdks-java-harness.jar`` (and slf4j) first on the classpath. Java's
PortableRunner stages the pipeline's whole classpath, so a pipeline that
depends on ``beam-sdks-java-harness`` (and ``jamm``, which the harness jar
declares but does not bundle) brings the harness with it; that is the
default here. A pipeline that does not (its jar has only the SDK core)
names the harness's jars in a directory or classpath, ahead of the staged
jars:

    --harness_classpath=/opt/beam/harness/*   (after "java" in the command)
    BEAM_PYSPARK_JAVA_HARNESS_CLASSPATH=...   (the executor's environment,
                                               or the config's "env")

Other JVM arguments: ``--jvm_arg=-Xmx2g`` (repeatable) or
``BEAM_PYSPARK_JAVA_OPTS`` (split as a shell would). ``java`` is
``$JAVA_HOME/bin/java`` where JAVA_HOME is set, else the one on PATH (Spark
needs Java 17+ on every executor already).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import shlex
from typing import Optional
from typing import Sequence

from beam_pyspark.boot import common
from beam_pyspark.javahome import find_java

_LOGGER = logging.getLogger('beam_pyspark.boot.java')

ENV_HARNESS_CLASSPATH = 'BEAM_PYSPARK_JAVA_HARNESS_CLASSPATH'
ENV_JAVA_OPTS = 'BEAM_PYSPARK_JAVA_OPTS'
MAIN_CLASS = 'org.apache.beam.fn.harness.FnHarness'
_HARNESS_JAR = 'beam-sdks-java-harness'
# The container's JVM flags (boot.go): throughput GC, full stack traces.
_JVM_DEFAULTS = ('-XX:+UseParallelGC', '-XX:-OmitStackTraceInFastThrow')


def parse_extra(extra: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog='python -m beam_pyspark.boot java')
  p.add_argument('--harness_classpath',
                 default=os.environ.get(ENV_HARNESS_CLASSPATH, ''))
  p.add_argument('--jvm_arg', action='append', default=[])
  flags, _ = p.parse_known_args(list(extra))
  return flags


def expand_classpath(classpath: str) -> list[str]:
  """A classpath's entries, with ``dir/*`` and plain directories of jars
  expanded to their jars (sorted, for the same order on every host)."""
  out: list[str] = []
  for entry in filter(None, classpath.split(os.pathsep)):
    if entry.endswith('*'):
      out.extend(sorted(glob.glob(entry + '.jar')))
    elif os.path.isdir(entry) and glob.glob(os.path.join(entry, '*.jar')):
      out.extend(sorted(glob.glob(os.path.join(entry, '*.jar'))))
    else:
      out.append(entry)
  return out


def _is_harness_jar(path: str) -> bool:
  return os.path.basename(path).startswith(_HARNESS_JAR)


def _is_jamm(path: str) -> bool:
  return os.path.basename(path).startswith('jamm')


def classpath(ctx: common.BootContext, harness_classpath: str) -> list[str]:
  """The harness's classpath: the named harness jars (if any), then the
  environment's staged jars in their staged order (boot.go keeps it)."""
  staged = [a.path for a in ctx.artifacts]
  harness = expand_classpath(harness_classpath)
  if not harness and not any(_is_harness_jar(p) for p in staged):
    raise common.BootError(
        'The staged jars have no beam-sdks-java-harness jar, and no harness '
        'classpath is named. Add org.apache.beam:beam-sdks-java-harness (and '
        'com.github.jbellis:jamm) to the pipeline\'s dependencies, or name '
        'a directory of the harness\'s jars: "python -m beam_pyspark.boot '
        f'java --harness_classpath=DIR/*" or {ENV_HARNESS_CLASSPATH}=DIR/*.')
  check_harness_version(harness, staged)
  return harness + staged


# beam-sdks-java-core-2.62.0.jar; staged by Java's PortableRunner with a
# hash after the version (beam-sdks-java-core-2.62.0-<hash>.jar).
_BEAM_JAR = re.compile(r'^beam-sdks-java-(core|harness)-(\d+\.\d+\.\d+)')


def _beam_jar_versions(paths: Sequence[str], kind: str) -> set[str]:
  found = set()
  for path in paths:
    m = _BEAM_JAR.match(os.path.basename(path))
    if m and m.group(1) == kind:
      found.add(m.group(2))
  return found


def check_harness_version(harness: Sequence[str],
                          staged: Sequence[str]) -> None:
  """A named harness classpath must be the pipeline's Beam version: the
  harness runs the SDK's classes (the staged ones come after it), and
  another version's fails on them in ways that name neither. The staged
  harness jar is the client's own, so only a named one is checked."""
  named = _beam_jar_versions(harness, 'harness')
  sdk = _beam_jar_versions(staged, 'core') or _beam_jar_versions(
      harness, 'core')
  if named and sdk and named != sdk:
    raise common.BootError(
        f'The harness classpath has Beam Java {", ".join(sorted(named))}\'s '
        f'harness; the pipeline\'s SDK (beam-sdks-java-core) is Beam '
        f'{", ".join(sorted(sdk))}. Name the harness jars of the same version '
        '(org.apache.beam:beam-sdks-java-harness and its dependencies from '
        'Maven Central), or stage beam-sdks-java-harness with the pipeline '
        '(its own version then runs).')


# FnHarness reads its options from PIPELINE_OPTIONS_FILE since Beam 2.50.0;
# an older one only from PIPELINE_OPTIONS (its own container's boot set
# that), and without it fails at start on a null "content" in Jackson.
_OPTIONS_FILE_SINCE = (2, 50)
# Linux's limit on one environment string (MAX_ARG_STRLEN, 32 pages).
_MAX_ENV_VALUE = 128 * 1024 - 1


def options_in_variable(cp: Sequence[str], options: str) -> bool:
  """Whether the harness needs the options in PIPELINE_OPTIONS too: its
  harness jar is older than Beam 2.50, or of no version the jar's name
  says (a pipeline's own fat jar) and the options fit in a variable."""
  named = _beam_jar_versions(cp, 'harness')
  old = sorted(v for v in named if tuple(
      int(p) for p in v.split('.')[:2]) < _OPTIONS_FILE_SINCE)
  if named and not old:
    return False
  if len(options.encode('utf-8')) <= _MAX_ENV_VALUE:
    return True
  if old:
    raise common.BootError(
        f'Beam Java {old[0]}\'s harness reads its pipeline options only from '
        f'the PIPELINE_OPTIONS variable, and this job\'s options are '
        f'{len(options.encode("utf-8"))} bytes, over Linux\'s limit of one '
        'variable (128 KiB). Submit with Beam Java 2.50 or newer (its harness '
        'reads them from a file), or with smaller options.')
  return False


def _pipeline_options(ctx: common.BootContext) -> dict:
  return json.loads(ctx.options_json() or '{}')


def jvm_args(ctx: common.BootContext, cp: list[str],
             extra_args: Sequence[str]) -> list[str]:
  """JVM flags as boot.go builds them, from the job's options."""
  options = _pipeline_options(ctx)
  opts = options.get('options', options)
  text = json.dumps(options)
  args = list(_JVM_DEFAULTS)
  jamm = next((p for p in cp if _is_jamm(p)), None)
  if jamm and 'disable_jamm_agent' not in text:
    # The harness's caches measure object sizes with jamm's agent.
    args.append('-javaagent:' + jamm)
  if opts.get('enableHeapDumps'):
    dumps = os.path.join(ctx.semi_persist_dir, 'heapdumps')
    args += ['-XX:+HeapDumpOnOutOfMemoryError',
             f'-Dbeam.fn.heap_dump_dir={dumps}',
             f'-XX:HeapDumpPath={os.path.join(dumps, "heap_dump.hprof")}']
  args += [f'--add-opens={m}' for m in opts.get('jdkAddOpenModules') or ()]
  args += [f'--add-modules={m}' for m in opts.get('jdkAddRootModules') or ()]
  args += shlex.split(os.environ.get(ENV_JAVA_OPTS, ''))
  args += list(extra_args)
  return args


def java_executable() -> str:
  found = find_java()
  if not found:
    raise common.BootError(
        'No java on PATH and no JAVA_HOME: the Java harness needs Java '
        '(the version the pipeline was compiled for, 11+).')
  return found


def harness_env(ctx: common.BootContext, options_file: str,
                base: Optional[dict] = None,
                options_variable: Optional[str] = None) -> dict:
  """The environment variables FnHarness.main reads; PIPELINE_OPTIONS
  only as ``options_variable`` (an old harness's), else the file is the
  one source."""
  env = dict(os.environ if base is None else base)
  env.pop('PIPELINE_OPTIONS', None)
  if options_variable is not None:
    env['PIPELINE_OPTIONS'] = options_variable
  env.update(HARNESS_ID=ctx.worker_id, PIPELINE_OPTIONS_FILE=options_file)
  for name, value in ctx.fn_api_env().items():
    if value is None:
      env.pop(name, None)
    else:
      env[name] = value
  return env


def command(ctx: common.BootContext) -> tuple[list[str], dict]:
  """The harness's argv and environment (what ``main`` execs)."""
  flags = parse_extra(ctx.extra)
  cp = classpath(ctx, flags.harness_classpath)
  # Options go in a file, as boot.go's MakePipelineOptionsFileAndEnvVar
  # does: a large job's options may pass the limit of one variable.
  options = ctx.options_json()
  options_file = os.path.join(ctx.semi_persist_dir, 'pipeline_options.json')
  with open(options_file, 'w', encoding='utf-8') as f:
    f.write(options)
  argv = [java_executable()] + jvm_args(ctx, cp, flags.jvm_arg) + [
      '-cp', os.pathsep.join(cp), MAIN_CLASS]
  return argv, harness_env(
      ctx, options_file,
      options_variable=options if options_in_variable(cp, options) else None)


def main(ctx: common.BootContext) -> None:
  argv, env = command(ctx)
  _LOGGER.info('Java harness %s: %d jars on its classpath', ctx.worker_id,
               len(argv[argv.index('-cp') + 1].split(os.pathsep)))
  common.exec_harness(argv, env)
