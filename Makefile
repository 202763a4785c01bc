# One virtual environment, built from scratch on first use: `make test`, `make demo`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
# CPU build of torch, pinned first so nothing pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install lint test test-unit test-multirank test-e2e test-fast test-twinkle test-triton-image demo bench clean

$(STAMP):
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[megatron,deepspeed,loggers,test]"
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider tests

# One tier at a time (markers applied by tests/conftest.py): unit (one process), multirank
# (real gloo ranks, tests/*_dist.py), e2e (launch scripts, megatron-core's loop, the wheel).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m unit tests

test-multirank: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m multirank tests

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q -p no:cacheprovider -m e2e tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -p no:cacheprovider tests/test_base.py

demo: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH bash launch/demo.sh

# tests/test_twinkle_compat.py against the real twinkle-kit too (installed only in benchmarks/.venv).
test-twinkle:
	[ -x benchmarks/.venv/bin/python ] || bash benchmarks/setup_env.sh
	benchmarks/.venv/bin/python -c "import pytest" 2>/dev/null || benchmarks/.venv/bin/python -m pip install -q pytest
	benchmarks/.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_twinkle_compat.py

# The kernels compiled with the Triton of the GPU image this project measures on (3.6), beside
# the one the test extra installs: every variant must build there too.
TRITON_IMAGE_VERSION ?= 3.6.0
test-triton-image: install
	[ -d .triton-$(TRITON_IMAGE_VERSION) ] || .venv/bin/python -m pip install -q --no-deps \
		--target .triton-$(TRITON_IMAGE_VERSION) triton==$(TRITON_IMAGE_VERSION)
	PYTHONPATH=.triton-$(TRITON_IMAGE_VERSION) .venv/bin/python -m pytest -q -p no:cacheprovider -p no:xdist \
		tests/test_triton_kernels.py -k "compiles or fewer or float64_constant"

# Benchmarks run in their own environment (benchmarks/.venv: peers twinkle-kit, torchmetrics).
bench:
	bash benchmarks/run_all.sh

clean:
	rm -rf $(VENV) runs
