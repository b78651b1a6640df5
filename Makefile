VENV ?= .venv
# stages run at once by `make repro` (JOBS=1: one at a time, as plain `dvc repro`)
JOBS ?= $(shell nproc 2>/dev/null || echo 1)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup repro quickstart test lint
setup: $(VENV)/.setup-done
$(VENV)/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

repro: setup         ## the whole pipeline on the default params, one stage per core at a time
	attnzoo repro --jobs $(JOBS)

quickstart: setup   ## three real models through the whole pipeline, then answering (about 15 minutes on 2 cores)
	attnzoo quickstart --jobs $(JOBS)

test: setup          ## the test suite (pytest's "no tests collected" counts as a failure)
	python -m pytest -q --durations=25; status=$$?; \
	  if [ $$status -eq 5 ]; then echo "error: pytest collected no tests" >&2; fi; exit $$status

lint: setup
	ruff check models pipeline serving tests scripts
