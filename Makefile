# Two commands for a newcomer: `make demo` and `make test`. Both create .venv if missing.
# On a GPU machine, pick a CUDA build of torch: make test TORCH_SPEC='torch>=2.4'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.distcomm-installed

.PHONY: install demo test test-large test-gpu lint typecheck bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train.py --nproc 2
	$(BIN)/python examples/evaluate.py --nproc 2

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-large: $(STAMP)
	$(BIN)/python -m pytest -q -m large tests/test_large.py

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -rs tests/gpu

lint: $(STAMP)
	$(BIN)/ruff check distcomm tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy distcomm

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
