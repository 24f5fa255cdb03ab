# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint format clean bench bench-quick

# Re-install whenever the declared dependencies change.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP) lint
	$(BIN)/pytest

# Side-by-side benchmarks (BENCHMARKS.md, ~20 min on 2 cores); bench-quick: the 64 MiB state
# only (~1 min). On a machine with an accelerator: bash benchmarks/gpu.sh
bench: $(STAMP)
	$(BIN)/python benchmarks/compare.py
	$(BIN)/python benchmarks/restore_memory.py

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/compare.py --quick

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
