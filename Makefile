# The two commands of the README: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Two pytest-xdist workers, a test class or module to each at a time: half
# of the suite's time is spent waiting (job servers starting, PeriodicImpulse
# and TestStream pipelines that run for their wall-clock seconds, killed
# drivers restarting), so two share 2 cores well (40 -> 24-26 minutes).
PYTEST_WORKERS ?= --numprocesses=2 --dist=loadscope

.PHONY: setup demo test bench clean sdk-java

$(STAMP): pyproject.toml
	@scripts/ensure-java.sh
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

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

# Beam's Java SDK (Maven, into ~/.m2) for tests/test_sdk_java*.py; again
# only when sdks/java/pom.xml changes.
JAVA_SDK_STAMP := sdks/java/target/classpath.txt
$(JAVA_SDK_STAMP): sdks/java/pom.xml scripts/sdk-java.sh
	@scripts/sdk-java.sh
sdk-java: $(JAVA_SDK_STAMP)

# pytest exits 5 when it collected no test: that is a failure here, never
# a pass.
# The status page's browser tests drive Debian's chromium: the tests (not
# the demo) install it, as set-up installs Java.
test: setup sdk-java
	@scripts/ensure-browser.sh
	@$(VENV)/bin/python -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# The benchmarks side by side: our runner, hand-written PySpark and Beam's
# DirectRunner, medians and ratios (README, Benchmarks).  A few minutes at
# this size; the README's table used BENCH_ARGS='--size-mb 200'.
BENCH_ARGS ?= --size-mb 10 --repeats 3
bench: setup
	$(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) out build *.egg-info
