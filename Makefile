# Two commands for a newcomer: `make demo` and `make test`. Both create .venv if missing.
# On a GPU machine, pick a CUDA build of torch: make test TORCH_SPEC='torch>=2.4'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.distcomm-runtime
STAMP := $(VENV)/.distcomm-installed
# make bench times small calls of this code beside this earlier commit's (the last before the membership work)
AGAINST ?= 2e312e0

.PHONY: help install demo test test-slow test-launchers test-all test-large test-gpu lint typecheck bench bench-full bench-tensors bench-wire bench-store \
	bench-simulate bench-recovery clean

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

# What the demo runs: torch, numpy, cloudpickle and distcomm itself.
$(RUNTIME): pyproject.toml Makefile
	@echo "==> set-up, once: a virtual environment in $(VENV) (about a minute)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> [1/3] upgrading pip"
	@$(BIN)/python -m pip install -q --upgrade pip
	@echo "==> [2/3] installing $(TORCH_SPEC) (the CPU build: the largest step, about a minute)"
	@$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	@echo "==> [3/3] installing distcomm (editable) with numpy and cloudpickle"
	@PYTHONWARNINGS=ignore $(BIN)/python -m pip install -q -e .  # quiet the build backend's notices
	@touch $(RUNTIME)
	@echo "==> set-up done"

# The tests' and the house's tools on top: pytest (with xdist), ruff, mypy, hypothesis, matplotlib, mmengine-lite.
$(STAMP): $(RUNTIME)
	@echo "==> installing the dev tools: pytest, ruff, mypy, hypothesis, matplotlib, mmengine-lite"
	@PYTHONWARNINGS=ignore $(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install distcomm with its dev tools

demo: $(RUNTIME)  ## the example training and evaluation jobs on 2 CPU processes (installs only what they run)
	$(BIN)/python examples/train.py --nproc 2
	$(BIN)/python examples/evaluate.py --nproc 2

test: $(STAMP)  ## the suite but its slow tests and the launcher tier, two test processes at once (7-9 minutes on 2 cores)
	$(BIN)/python -m pytest -q -n 2

test-slow: $(STAMP)  ## only the slow tests: large worlds, timeouts, launch, torchrun, README blocks, a rotating sample of the kill campaign (25-28 minutes on 2 cores)
	$(BIN)/python -m pytest -q -m slow

test-launchers: $(STAMP)  ## real srun, sbatch, mpirun, torchrun with restarts, hosts in network namespaces (root; installs slurm-wlm, openmpi-bin)
	$(BIN)/python -m pytest -q -m launchers tests/launchers

test-all: $(STAMP)  ## everything but the 12 GiB tests and the launcher tier: make test and make test-slow in one run
	$(BIN)/python -m pytest -q -m "not large and not launchers"

test-large: $(STAMP)  ## payloads over 2 GiB (about 12 GiB of RAM)
	$(BIN)/python -m pytest -q -m large tests/test_large.py

test-gpu: $(STAMP)  ## NcclCommunicator on the visible GPUs
	$(BIN)/python -m pytest -q -rs tests/gpu

lint: $(STAMP)  ## ruff
	$(BIN)/ruff check distcomm tests examples benchmarks

typecheck: $(STAMP)  ## mypy --strict
	$(BIN)/mypy distcomm

bench: $(STAMP)  ## quick timing against torch at 2-16 ranks (bytes per call beside time), small calls beside an earlier commit's (AGAINST=2e312e0), tensor collectives, async overlap, what the job's key costs (writes benchmarks/out/)
	$(BIN)/python benchmarks/run.py --quick
	$(BIN)/python benchmarks/against.py --commit $(AGAINST)
	$(BIN)/python benchmarks/tensors.py --quick
	$(BIN)/python benchmarks/overlap.py
	$(BIN)/python benchmarks/members_only.py

bench-full: $(STAMP)  ## the README's figures: full runs at 2-8 ranks, sweep, peak memory (benchmarks/results/)
	$(BIN)/python benchmarks/run.py --save
	$(BIN)/python benchmarks/tensors.py

bench-tensors: $(STAMP)  ## tensor all_reduce and all_gather_tensor against torch.distributed on the same group
	$(BIN)/python benchmarks/tensors.py

bench-wire: $(STAMP)  ## bytes on the wire per rank, one network namespace per rank (needs root)
	$(BIN)/python benchmarks/wire.py --world 8 16

bench-recovery: $(STAMP)  ## a killed rank to the survivors' next collective, to a DDP job's next step (and a replacement's stall), and in a 2x2 HSDP job to each replica's next step and the members' stall when the replica rejoins: shrink vs torchft and a torchrun restart; sync_state vs broadcast, 64 MiB-1 GiB
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python -m pip install -q --no-deps --target benchmarks/.deps torchft-nightly==2026.10.26
	$(BIN)/python -m pip install -q --target benchmarks/.deps "opentelemetry-sdk>=1.39.0" "opentelemetry-exporter-otlp-proto-http>=1.39.0"  # (torchft imports them)
	$(BIN)/python benchmarks/recovery_ddp.py
	$(BIN)/python benchmarks/recovery_hsdp.py --reps 3
	$(BIN)/python benchmarks/heal.py --sizes 64 192 1024 --striped

bench-store: $(STAMP)  ## the job's store under 64-1,024 simulated ranks: connecting at once, then keep-alives and agreement: calls/s and one call's latency
	$(BIN)/python benchmarks/store_load.py

bench-simulate: $(STAMP)  ## Python per rank per call against world size, up to 1,024 simulated ranks
	$(BIN)/python benchmarks/simulate.py

clean:  ## remove .venv and caches
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
