# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The oldest orbax-checkpoint that runs here, whose checkpoints tests/test_from_orbax.py opens.
OLD_ORBAX := .venv-orbax-0.2.3
OLD_STAMP := $(OLD_ORBAX)/.installed-stamp

.PHONY: demo test pytest lint docs docs-shots format clean bench bench-quick

# Re-install whenever the declared dependencies change.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

$(OLD_STAMP): tests/old_orbax/requirements.txt
	$(PYTHON) -m venv $(OLD_ORBAX)
	$(OLD_ORBAX)/bin/pip install --quiet --only-binary=:all: --no-binary=jax \
		-r tests/old_orbax/requirements.txt
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# lint and the docs build run beside pytest (each still fails the target); the output of
# each is printed whole once it is done.
test: $(STAMP) $(OLD_STAMP)
	$(MAKE) --no-print-directory -j3 --output-sync=target lint docs pytest

# Three workers on two cores: much of the suite's time is waiting (on a deadline, a
# lease's term, a server), which a third worker fills. The tests marked one_job_at_a_time
# (tests/multihost.py) run on one of them, one after another, from the start (in the order
# collected, not largest group first: theirs is the longest); docs/development.md says more.
pytest: $(STAMP) $(OLD_STAMP)
	$(BIN)/pytest -n 3 --dist loadgroup --no-loadscope-reorder

# The documentation site, into site/: strict (mkdocs.yml), so a broken link, a missing
# anchor, a page left out of the nav or an unknown API name fails the build (never --quiet:
# it drops the warnings that --strict counts, and a broken build passes).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Screenshots of the built site in headless Chromium (Debian's package, installed first if
# missing; driven by Playwright, the `shots` extra), at a desktop and a phone width, and the
# pages its search finds first for API names, into runs/docs-shots/: to look at, not a test.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
docs-shots: docs
	command -v chromium >/dev/null || $(SUDO) apt-get install -y -q chromium \
		|| ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)
	$(BIN)/pip install --quiet -e '.[shots]'
	$(BIN)/python docs/shots.py

# Side-by-side benchmarks (~55 min on 2 cores): each writes its page under
# benchmarks/results/, then compare.py writes BENCHMARKS.md, one current page, its own
# tables first and every other page after. bench-quick: the 64 MiB state only (~1 min).
# On a machine with an accelerator: bash benchmarks/gpu.sh
bench: $(STAMP)
	$(BIN)/python benchmarks/restore_memory.py
	$(BIN)/python benchmarks/orbax_written.py
	$(BIN)/python benchmarks/leaf_sweep.py
	$(BIN)/python benchmarks/many_steps.py
	$(BIN)/python benchmarks/local_tier.py
	$(BIN)/python benchmarks/scale.py
	$(BIN)/python benchmarks/faults.py
	$(BIN)/python benchmarks/full_saves.py
	$(BIN)/python benchmarks/compare.py

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/compare.py --quick

# mypy: the whole package, strictly where the public API is defined ([tool.mypy] in
# pyproject.toml says which modules, and which dependencies ship no types).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) $(OLD_ORBAX) runs site .jax-cache .pytest_cache .ruff_cache .mypy_cache
