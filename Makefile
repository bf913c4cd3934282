# The two commands of the README: `make demo` and `make test`. `make docs`
# builds the documentation site (mkdocs.yml) into site/.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Three pytest-xdist workers, a test class or module to each at a time: most
# of the suite's time is spent waiting (job servers and JVMs starting,
# PeriodicImpulse and TestStream pipelines that run for their wall-clock
# seconds, killed drivers restarting): a clean-clone run took 62 minutes
# with two (over CI's hour), 54 with three, on 2 cores.
# Longest scopes first (tests/conftest.py, tests/scope_durations.json),
# not pytest-xdist's order by number of tests, which ran the one-test Java
# ValidatesRunner module (~15 minutes) last, alone.
PYTEST_WORKERS ?= --numprocesses=3 --dist=loadscope --no-loadscope-reorder

.PHONY: setup sdk-typescript sdk-go sdk-java sdk-java-old sdk-python-versions sdk-xlang hdfs-minicluster connect-client demo test bench bench-kafka bench-kafka-jars clean

$(STAMP): pyproject.toml scripts/setup-venv.sh
	@scripts/setup-venv.sh $(PYTHON) $(VENV) test
	@touch $(STAMP)

setup: $(STAMP)

# Beam's TypeScript SDK (npm apache-beam 2.49.0) and the pipelines
# tests/test_sdk_typescript.py submits with it: npm ci from the lock file
# (npm's cache, ~/.npm, keeps the downloads; again only when the lock file
# changes). --ignore-scripts: the one install script among them is
# protobufjs's postinstall, for its pbjs command line, which nothing runs.
TS_DIR := sdks/typescript
TS_STAMP := $(TS_DIR)/node_modules/.installed-stamp
$(TS_STAMP): $(TS_DIR)/package.json $(TS_DIR)/package-lock.json
	cd $(TS_DIR) && npm ci --prefer-offline --ignore-scripts --no-audit --no-fund
	@touch $(TS_STAMP)

sdk-typescript: $(TS_STAMP)

# Beam's own WordCount, unchanged, on local Spark, over the shipped sample.
demo: setup
	@rm -rf out/demo && mkdir -p out/demo
	$(VENV)/bin/python -m apache_beam.examples.wordcount \
	  --runner=beam_pyspark.PySparkRunner \
	  --input examples/data/sample.txt \
	  --output out/demo/counts
	@echo
	@echo "Word counts written to: $$(ls out/demo/counts*)"
	@echo "Most frequent words:"
	@sort -t: -k2 -n -r out/demo/counts* | head -5

# The services the docs use, one in the foreground, until Ctrl-C
# (docs/local-services.md): each resolves what it needs first. Flags go in
# LOCAL_ARGS, e.g. make kafka LOCAL_ARGS='--topic events:3'.
.PHONY: kafka hdfs s3 expansion-services
LOCAL_ARGS ?=
kafka: setup sdk-xlang
	@$(VENV)/bin/beam-pyspark local kafka $(LOCAL_ARGS)
hdfs: setup hdfs-minicluster
	@$(VENV)/bin/beam-pyspark local hdfs $(LOCAL_ARGS)
s3: setup
	@$(VENV)/bin/beam-pyspark local s3 $(LOCAL_ARGS)
expansion-services: setup sdk-xlang
	@$(VENV)/bin/beam-pyspark local expansion-services $(LOCAL_ARGS)

# Beam's Java SDK (Maven, into ~/.m2) for tests/test_sdk_java*.py; again
# only when sdks/java/pom.xml changes.
JAVA_SDK_STAMP := sdks/java/target/classpath.txt
$(JAVA_SDK_STAMP): sdks/java/pom.xml sdks/java/examples/pom.xml scripts/sdk-java.sh
	@scripts/sdk-java.sh
sdk-java: $(JAVA_SDK_STAMP)

# An older Beam Java client (tests/test_version_skew.py, issue 43): Beam
# 2.48.0's WordCount, PortableRunner and DirectRunner, into ~/.m2 as above
# (~55 MB, a minute the first time); Maven comes with sdk-java.
JAVA_OLD_STAMP := sdks/java-old/target/classpath.txt
$(JAVA_OLD_STAMP): sdks/java-old/pom.xml scripts/sdk-java-old.sh | $(JAVA_SDK_STAMP)
	@scripts/sdk-java-old.sh
sdk-java-old: $(JAVA_OLD_STAMP)

# Older Beam Python clients (tests/test_version_skew.py): a virtualenv per
# version with that apache-beam from PyPI, in the versioned harnesses' own
# cache (beam_pyspark.boot.python: ~/.cache/beam-pyspark/harness, or
# $BEAM_PYSPARK_PYTHON_HARNESSES), outside the work tree, so a fresh clone
# (CI's) finds them made; the tests' harnesses of those versions are the
# same virtualenvs. A first build takes minutes (1.5-3 per version, pip's
# cache keeps the downloads); with them made, a second or two.
OLD_BEAM_VERSIONS := 2.61.0 2.66.0
sdk-python-versions: setup
	@$(VENV)/bin/python -m beam_pyspark.boot.python $(OLD_BEAM_VERSIONS)

# Multi-language pipelines (docs/multi-language.md): Beam's Java expansion
# services for Beam SQL and KafkaIO (Beam 2.71.0), Apache Kafka's broker
# for the tests, and the Java side of Beam's cross-language ValidatesRunner
# suite (sdks/xlang/validates), resolved by Maven into ~/.m2; again only
# when a pom or a registrar changes.
XLANG_STAMP := sdks/xlang/.resolved
$(XLANG_STAMP): sdks/xlang/sql/pom.xml sdks/xlang/kafka/pom.xml \
  sdks/xlang/broker/pom.xml sdks/xlang/validates/pom.xml scripts/sdk-xlang.sh \
  $(wildcard sdks/xlang/sql/src/main/java/beampyspark/xlang/*.java) \
  $(wildcard sdks/xlang/validates/src/main/java/beampyspark/xlang/validates/*.java)
	@scripts/sdk-xlang.sh
sdk-xlang: $(XLANG_STAMP)

# Apache Hadoop's MiniDFSCluster (Maven, into ~/.m2) for the HDFS
# checkpoint tests (tests/test_checkpoint_hdfs.py); again only when
# tests/hdfs/pom.xml changes.
HDFS_STAMP := tests/hdfs/target/classpath.txt
$(HDFS_STAMP): tests/hdfs/pom.xml scripts/minicluster.sh
	@scripts/minicluster.sh hdfs
hdfs-minicluster: $(HDFS_STAMP)

# A Spark Connect client as docs/spark-connect.md installs one: PyPI's
# pyspark-client (Connect only; 4.2 is its newest, no 4.3 exists) as its
# pyspark, against Spark 4.3's Connect server in tests/test_connect.py.
# Its other libraries (Beam, pandas, Arrow, gRPC) are the .venv's, added
# after its own site-packages, so the pyspark it imports is the client's.
CONNECT_CLIENT := .venv-connect-client
CONNECT_CLIENT_STAMP := $(CONNECT_CLIENT)/.installed-stamp
$(CONNECT_CLIENT_STAMP): $(STAMP)
	@test -x $(CONNECT_CLIENT)/bin/python || $(PYTHON) -m venv $(CONNECT_CLIENT)
	$(CONNECT_CLIENT)/bin/python -m pip install -q --no-deps 'pyspark-client==4.2.*'
	@$(CONNECT_CLIENT)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > $(CONNECT_CLIENT)/.purelib
	@echo "import site; site.addsitedir('$$($(VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
	  > "$$(cat $(CONNECT_CLIENT)/.purelib)/zz_beam_pyspark_venv.pth"
	@touch $(CONNECT_CLIENT_STAMP)
connect-client: $(CONNECT_CLIENT_STAMP)

# pytest exits 5 when it collected no test: that is a failure here, never
# a pass.
# The status page's browser tests drive Debian's chromium: the tests (not
# the demo) install it, as set-up installs Java.
test: setup sdk-typescript sdk-go sdk-java sdk-java-old sdk-python-versions sdk-xlang \
  hdfs-minicluster yarn-minicluster connect-client
	@scripts/ensure-browser.sh
	@$(VENV)/bin/python -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# The documentation site, strict: a broken link or #anchor, or a page left
# out of the nav, fails the build (tests/test_docs_site.py builds it too).
.PHONY: docs
docs: setup
	$(VENV)/bin/python -m mkdocs build --strict --site-dir site
	@echo "Documentation built: site/index.html"

# The benchmarks side by side: our runner, hand-written PySpark and Beam's
# DirectRunner, medians and ratios (docs/benchmarks.md).  A few minutes at
# this size; its tables used BENCH_ARGS='--size-mb 200'.
BENCH_ARGS ?= --size-mb 10 --repeats 3
bench: setup
	$(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)

# PyFlink for the streaming benchmark's peer (benchmarks/streaming_throughput.py,
# --flink-python): PyPI's apache-flink in a virtualenv of its own (it pins
# an older apache-beam than ours), never part of `make test`. Made once
# (~850 MB; remove .venv-flink to make it again); pip's cache keeps the
# downloads.
.PHONY: bench-flink bench-streaming
FLINK_VENV := .venv-flink
FLINK_STAMP := $(FLINK_VENV)/.installed-stamp
$(FLINK_STAMP):
	@test -x $(FLINK_VENV)/bin/python || $(PYTHON) -m venv $(FLINK_VENV)
	$(FLINK_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLINK_VENV)/bin/python -m pip install -q 'apache-flink==2.3.*'
	@touch $(FLINK_STAMP)
bench-flink: $(FLINK_STAMP)

# The streaming benchmark (docs/benchmarks.md): ours, PySpark Structured
# Streaming as its users run it (the [bench] extra: pyspark[sql]'s pyarrow
# and pandas, Spark's default Arrow-optimized UDF), the same with the
# pickled UDF, and PyFlink at its defaults, at rising offered rates.
STREAM_BENCH_ARGS ?=
bench-streaming: setup bench-flink
	$(VENV)/bin/python -m benchmarks.streaming_throughput \
	  --flink-python $(FLINK_VENV)/bin/python $(STREAM_BENCH_ARGS)

# Kafka streaming, ours against hand-written PySpark Structured Streaming
# with Spark's own Kafka source (docs/guide/kafka.md). Spark's connector
# (spark-sql-kafka-0-10 for Scala 2.13: 4.2.0, the newest on Maven Central;
# pyspark 4.3.0's is not served) is the benchmark's only: never the tests'.
SPARK_KAFKA := sdks/xlang/spark-kafka/target/classpath.txt
$(SPARK_KAFKA): sdks/xlang/spark-kafka/pom.xml
	cd sdks/xlang/spark-kafka && mvn -B -q dependency:build-classpath \
	  -Dmdep.outputFile=target/classpath.txt
bench-kafka-jars: $(SPARK_KAFKA)
KAFKA_BENCH_ARGS ?=
bench-kafka: setup sdk-xlang bench-kafka-jars
	$(VENV)/bin/python -m benchmarks.kafka_stream $(KAFKA_BENCH_ARGS)

# Beam's Go SDK (the module proxy's github.com/apache/beam/sdks/v2, pinned
# in sdks/go/go.mod): Go's wordcount and Beam's Go integration test
# packages, compiled for tests/test_sdk_go*.py (docs/sdks/go.md). Downloads
# go to Go's module cache, compiled packages to its build cache: a first
# build takes minutes on 2 cores, a cached one seconds (links only).
# -ldflags=-w leaves out DWARF (a third of the link); the Go SDK finds its
# functions by the ELF symbol table, which stays.
GO ?= go
GO_BIN := sdks/go/bin
GO_BEAM := github.com/apache/beam/sdks/v2/go
GO_TEST_PACKAGES := $(GO_BEAM)/test/integration/primitives \
  $(GO_BEAM)/test/integration/synthetic \
  $(GO_BEAM)/test/integration/wordcount $(GO_BEAM)/test/regression
# Go's examples the tests compare with Go's own runners (wordcount, and the
# windowed and sharded writes of tests/test_sdk_examples.py).
GO_EXAMPLES := wordcount windowed_wordcount large_wordcount
$(GO_BIN)/.built-examples: sdks/go/go.mod sdks/go/go.sum
	@command -v $(GO) >/dev/null || { echo "make sdk-go: no 'go' on PATH (Go 1.26 or later is needed)" >&2; exit 1; }
	cd sdks/go && $(GO) mod download
	cd sdks/go && for e in $(GO_EXAMPLES); do \
	  $(GO) build -ldflags=-w -o bin/$$e $(GO_BEAM)/examples/$$e || exit 1; done
	cd sdks/go && $(GO) test -c -ldflags=-w -o bin/ $(GO_TEST_PACKAGES)
	@touch $@

sdk-go: $(GO_BIN)/.built-examples

clean:
	rm -rf $(VENV) out build *.egg-info $(TS_DIR)/node_modules $(GO_BIN) \
	  sdks/xlang/*/target $(XLANG_STAMP)

# Hadoop's MiniYARNCluster (with a MiniDFSCluster) for tests/test_yarn.py
# (issue 42: Spark on YARN, docs/guide/clusters.md); again only when
# tests/yarn/pom.xml changes.
YARN_STAMP := tests/yarn/target/classpath.txt
$(YARN_STAMP): tests/yarn/pom.xml scripts/minicluster.sh
	@scripts/minicluster.sh yarn
.PHONY: yarn-minicluster
yarn-minicluster: $(YARN_STAMP)
