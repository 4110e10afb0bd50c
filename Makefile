# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Python 3.12: requirements.lock is resolved on it, and jax 0.12 (whose CUDA plugin compiles for
# the GPU targets) needs it. The first that runs as 3.12 of `python3.12` on the PATH, pyenv's
# 3.12 releases and `python3`; `make PYTHON=/path/to/python3.12` names one.
PYTHON ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 python3; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { command -v "$$p"; break; }; done)
# The oracle's venv keeps Python 3.11, where this machine's disk has torch's CPU wheel.
ORACLE_PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Eight JAX devices on the CPU, so data-parallel code runs for real without an accelerator.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu
# Bytecode caches for the project's own modules and pytest's rewritten test files: every test
# process, and every worker and render the tests start, imports them; with PYTHONDONTWRITEBYTECODE
# set each would compile them from source again.
unexport PYTHONDONTWRITEBYTECODE

# The tests run a real redis-server and drive a real headless Chromium (Debian's packages).
SYSTEM_PACKAGES := redis-server chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test check bench soak lock clean system-packages oracle python

# Refuses to go on without a Python 3.12, saying where to get one; a venv of another Python
# (made before the move to 3.12) is made anew.
python:
	@[ -n "$(PYTHON)" ] || { echo "No Python 3.12 found (python3.12, pyenv's 3.12.x or python3): requirements.lock needs" \
		"one. Install it (pyenv install 3.12, or the system's python3.12 package) or name it:" \
		"make PYTHON=/path/to/python3.12. On Python 3.11, pip install -e '.[worker,test]' without the lock" \
		"gets jax 0.10.2, without GPU targets (README)." >&2; exit 1; }
	@if [ -x $(BIN)/python ] && [ "$$($(BIN)/python -V 2>&1)" != "$$($(PYTHON) -V 2>&1)" ]; then \
		echo "$(VENV) runs $$($(BIN)/python -V 2>&1), not $$($(PYTHON) -V 2>&1): making it anew"; rm -rf $(VENV); fi

# cuDNN for the GPU targets' cuDNN attention (diffusion/targets.py), without the cuBLAS its wheel
# asks for: compiling loads libcudnn and libcudnn_graph only (pyproject.toml, the test extra).
CUDNN := nvidia-cudnn-cu12>=9.10.2.21,<10

$(BIN)/.installed: pyproject.toml requirements.lock | python
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -c requirements.lock -e ".[worker,test]"
	$(BIN)/python -m pip install -q -c requirements.lock --no-deps "$(CUDNN)"
	touch $@

# The benchmarks also measure PNG sizes on photographs that scikit-image ships (bench/host.py png).
$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/python -m pip install -q -c requirements.lock -e ".[worker,test,bench]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/renderfarm tiny-model build/tiny-sd --kind sd
	$(BIN)/renderfarm render --model build/tiny-sd --prompts examples/prompts.txt \
		--out out --campaign demo --seed 0 --steps 4
	@echo "images, sidecars, manifest.jsonl and the gallery (index.html, preview.png) are in out/demo/"

# Three test processes on two cores: compiling is single-threaded, and many tests spend their
# time waiting (on worker processes, on Redis, on a schedule's clock). tests/conftest.py keeps the
# farm's tests to one process and gives them all one compile cache. The run ends with its 25
# slowest steps (setups included), where to look first to make it faster.
TEST_PROCESSES ?= 3
test: $(BIN)/.installed system-packages
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --durations=25

# A change's inner loop: everything but the farm's worker processes, the oracle's renders, Chromium,
# the compiles for other accelerators and the benchmarks' smoke runs.
check: $(BIN)/.installed system-packages
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) -m "not farm and not oracle and not browser and not target and not bench"

# The soak of every fault (tests/test_soak.py) at ten times the size `make test` runs: 10,000 jobs under
# 160 faults, an hour at most (docs/operations.md, "A soak of every fault"); RENDERFARM_SOAK_SEED=N replays one.
soak: $(BIN)/.installed system-packages
	RENDERFARM_SOAK_SCALE=10 $(BIN)/python -m pytest -q -s -p no:randomly --timeout 3600 tests/test_soak.py

system-packages:
	@command -v redis-server >/dev/null && command -v chromium >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(SYSTEM_PACKAGES); }

# Five benchmarks, one question each (docs/performance.md): what a model costs per image on a chip
# (cost), how fast the engine renders against diffusers (engine), how many jobs per second the control
# plane moves (control), what storage and encoding cost beside the devices (host), what a windowed
# campaign holds in Redis (window). Each one's default is its fast part; flags and parts select the rest.
BENCHMARKS := cost engine control host window

bench: $(BIN)/.bench-installed system-packages
	set -e; for name in $(BENCHMARKS); do echo "== bench/$$name.py"; PYTHONPATH=. $(BIN)/python bench/$$name.py; done

# Regenerate the PyTorch reference data under tests/data/ (tiny checkpoints, reference images, scheduler
# and tokenizer references) with diffusers' own PyTorch code, in a venv of its own: not part of `make test`,
# which only reads what this writes. The venv is rebuilt when tests/oracle/requirements.txt changes.
ORACLE_VENV := build/oracle-venv
oracle:
	@if [ ! -f $(ORACLE_VENV)/.installed ] || [ tests/oracle/requirements.txt -nt $(ORACLE_VENV)/.installed ]; then \
		set -e; rm -rf $(ORACLE_VENV); $(ORACLE_PYTHON) -m venv $(ORACLE_VENV); \
		echo "$(ORACLE_VENV)/bin/python -m pip install -q -r tests/oracle/requirements.txt"; \
		$(ORACLE_VENV)/bin/python -m pip install -q -r tests/oracle/requirements.txt; \
		$(ORACLE_VENV)/bin/python -m pip install -q --no-deps open-clip-torch==3.3.0; \
		touch $(ORACLE_VENV)/.installed; \
	fi
	JAX_PLATFORMS=cpu $(ORACLE_VENV)/bin/python -m tests.oracle

# Re-resolve every dependency from scratch and write the lock (run after changing pyproject).
lock: python
	rm -rf build/lockenv && $(PYTHON) -m venv build/lockenv
	build/lockenv/bin/python -m pip install -q --upgrade "pip>=24"
	build/lockenv/bin/python -m pip install -q ".[worker,test,bench]"
	build/lockenv/bin/python -m pip install -q --no-deps "$(CUDNN)"
	build/lockenv/bin/python -m pip freeze --exclude renderfarm > requirements.lock

clean:
	rm -rf $(VENV) build out
