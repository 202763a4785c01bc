# Two virtual environments, each built from scratch on first use (stamp files):
#   .venv     Python 3.11 (PY), torch 2.13.0 CPU, megatron-core 0.16.1: the whole suite, `make demo`
#   .venv312  Python 3.12, torch 2.14.1, megatron-core 0.19.2: the tests marked `megatron`
#             (tests/conftest.py) and the demo
# `make test` (what .ci/run calls) runs the first, then the second.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CKSUM := $(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(CKSUM)
# CPU build of torch, pinned first so nothing pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
MEGATRON ?= megatron-core==0.16.1
EXTRAS := .[megatron,deepspeed,loggers,test]
# verl's metric code, for tests/integrations/test_verl*.py: without its dependencies (vllm, ray, transformers,
# ...), which those tests do not import (they read verl's files: tests/verlref.py)
VERL ?= verl==0.9.1

# The second leg. torch 2.14.1 is the registry's CUDA build (~3 GB of wheels with its nvidia
# libraries, pinning triton 3.8); it runs on CPU. Its wheels are kept in WHEELS312, outside the
# clone, so that a fresh clone on the same machine installs them without downloading them again
# (pip's own cache does not keep them here). PY312: a Python 3.12 interpreter, else found below.
VENV312 ?= .venv312
BIN312 := $(VENV312)/bin
STAMP312 := $(VENV312)/.installed-$(CKSUM)
TORCH312 ?= torch==2.14.1
WHEELS312 ?= $(HOME)/.cache/twinkle-metrics/wheels-py312
MEGATRON312 ?= megatron-core==0.19.2
# The first candidate that runs and is 3.12: $(PY312), python3.12 on PATH (a pyenv shim may
# exist and fail), pyenv's 3.12.1, any pyenv 3.12.x. Prints its path; nothing when none.
FIND_PY312 = for c in "$(PY312)" python3.12 "$$(pyenv prefix 3.12.1 2>/dev/null)/bin/python3.12" \
	    "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do \
	  [ -n "$$c" ] && "$$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1 \
	    && { command -v "$$c" || echo "$$c"; } && break; \
	done; true
# $(call pip,VENV,ARGS): pip install into VENV that names what failed (pip's output is above it)
pip = $(1)/bin/python -m pip install -q $(2) || { echo 'make: FAILED to install $(2) into $(1)' \
	"(pip's output above); fix it and run make again" >&2; exit 1; }

.PHONY: install install312 lint typecheck test test-newest run-newest test-unit test-multirank test-e2e test-fast test-twinkle \
	test-triton-image demo bench clean

$(STAMP):
	$(PY) -m venv $(VENV) || { echo "make: FAILED to create $(VENV) with $(PY)" >&2; exit 1; }
	$(call pip,$(VENV),--upgrade pip)
	$(call pip,$(VENV),"$(TORCH)")
	$(call pip,$(VENV),-e "$(EXTRAS)" "$(MEGATRON)")
	$(call pip,$(VENV),--no-deps "$(VERL)")
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

$(STAMP312):
	@py="$$($(FIND_PY312))"; [ -n "$$py" ] || { echo "make: no Python 3.12 (PY312, python3.12, pyenv)" >&2; exit 1; }; \
	echo "$$py -m venv $(VENV312)"; "$$py" -m venv $(VENV312) \
	  || { echo "make: FAILED to create $(VENV312) with $$py" >&2; exit 1; }
	$(call pip,$(VENV312),--upgrade pip)
	$(BIN312)/python -m pip download -q -d "$(WHEELS312)" "$(TORCH312)" || { echo "make: FAILED to download" \
	  "$(TORCH312) into $(WHEELS312) (pip's output above; a damaged file there: remove the folder)" >&2; exit 1; }
	$(call pip,$(VENV312),--no-index --find-links "$(WHEELS312)" "$(TORCH312)")
	$(call pip,$(VENV312),-e "$(EXTRAS)" "$(MEGATRON312)")
	$(BIN312)/python -c "import torch, megatron.core as m; torch.ones(2).sum(); \
	  print('$(VENV312): torch', torch.__version__, 'megatron-core', m.__version__)" \
	  || { echo "make: FAILED: $(VENV312) installed but torch or megatron-core does not import" >&2; exit 1; }
	rm -f $(VENV312)/.installed-* && touch $@

install312: $(STAMP312)

lint: $(STAMP)
	$(BIN)/ruff check .

# mypy over twinkle_metrics/ and parallel/ (its configuration: pyproject.toml [tool.mypy]).
typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider tests
	@$(MAKE) --no-print-directory test-newest

# The second leg alone. Without a Python 3.12 it says so and skips (exit 0) in a banner;
# REQUIRE_PY312=1 makes that a failure.
test-newest:
	@if [ -z "$$($(FIND_PY312))" ]; then \
	  echo "=================================================================================="; \
	  echo "SKIPPED: the megatron-core 0.19 leg (Python 3.12 + $(TORCH312) + $(MEGATRON312))."; \
	  echo "No Python 3.12 interpreter: not PY312='$(PY312)', not python3.12 on PATH, not in pyenv"; \
	  echo "('pyenv install 3.12.1', or make PY312=/path/to/python3.12). Only the first leg ran."; \
	  echo "=================================================================================="; \
	  [ -z "$(REQUIRE_PY312)" ] || exit 1; \
	else $(MAKE) --no-print-directory run-newest; fi

# The demo first: the run then closes on pytest's summary line.
run-newest: $(STAMP312)
	PATH=$(abspath $(BIN312)):$$PATH bash launch/demo.sh --set logging.progress=false
	$(BIN312)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m megatron tests

# One tier at a time (markers applied by tests/conftest.py): unit (one process), multirank
# (real gloo ranks, tests/**/*_dist.py), e2e (launch scripts, megatron-core's loop, the wheel).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m unit tests

test-multirank: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m multirank tests

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m e2e tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -p no:cacheprovider tests/core/test_base.py

demo: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH bash launch/demo.sh

# tests/integrations/test_twinkle_compat.py against the real twinkle-kit too (installed only in benchmarks/.venv).
test-twinkle:
	[ -x benchmarks/.venv/bin/python ] || bash benchmarks/setup_env.sh
	benchmarks/.venv/bin/python -c "import pytest" 2>/dev/null || benchmarks/.venv/bin/python -m pip install -q pytest
	benchmarks/.venv/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_twinkle_compat.py

# The kernels compiled with the Triton of the GPU image this project measures on (3.6), beside
# the one the test extra installs: every variant must build there too.
TRITON_IMAGE_VERSION ?= 3.6.0
test-triton-image: install
	[ -d .triton-$(TRITON_IMAGE_VERSION) ] || .venv/bin/python -m pip install -q --no-deps \
		--target .triton-$(TRITON_IMAGE_VERSION) triton==$(TRITON_IMAGE_VERSION)
	PYTHONPATH=.triton-$(TRITON_IMAGE_VERSION) .venv/bin/python -m pytest -q -p no:cacheprovider -p no:xdist \
		tests/kernels/test_triton_kernels.py -k "compiles or fewer or float64_constant"

# Benchmarks run in their own environment (benchmarks/.venv: peers twinkle-kit, torchmetrics).
bench:
	bash benchmarks/run_all.sh

clean:
	rm -rf $(VENV) $(VENV312) runs
