# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Eight JAX devices on the CPU, so data-parallel code runs for real without an accelerator.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

# The tests run a real redis-server and drive a real headless Chromium (Debian's packages).
SYSTEM_PACKAGES := redis-server chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test check bench lock clean system-packages oracle

$(BIN)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -c requirements.lock -e ".[worker,test]"
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

# A change's inner loop: everything but the farm's worker processes, the oracle's renders, Chromium
# and the compiles for other accelerators.
check: $(BIN)/.installed system-packages
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) -m "not farm and not oracle and not browser and not target"

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
		set -e; rm -rf $(ORACLE_VENV); $(PYTHON) -m venv $(ORACLE_VENV); \
		echo "$(ORACLE_VENV)/bin/python -m pip install -q -r tests/oracle/requirements.txt"; \
		$(ORACLE_VENV)/bin/python -m pip install -q -r tests/oracle/requirements.txt; \
		$(ORACLE_VENV)/bin/python -m pip install -q --no-deps open-clip-torch==3.3.0; \
		touch $(ORACLE_VENV)/.installed; \
	fi
	JAX_PLATFORMS=cpu $(ORACLE_VENV)/bin/python -m tests.oracle

# Re-resolve every dependency from scratch and write the lock (run after changing pyproject).
lock:
	rm -rf build/lockenv && $(PYTHON) -m venv build/lockenv
	build/lockenv/bin/python -m pip install -q --upgrade "pip>=24"
	build/lockenv/bin/python -m pip install -q ".[worker,test,bench]"
	build/lockenv/bin/python -m pip freeze --exclude renderfarm > requirements.lock

clean:
	rm -rf $(VENV) build out
