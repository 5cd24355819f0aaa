# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
#   make demo   set up, then a trainer pushes new weights into a served tiny model
#   make test   set up, lint, then every test (the slow end-to-end ones included;
#               TEST_WORKERS processes, default 2), then upstream vLLM 0.32.0's
#               own weight-transfer tests (test-upstream)

VENV := .venv
PY := $(VENV)/bin/python
FORK_PY = $(shell git ls-files '*.py')
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
UPSTREAM_PYTEST_ARGS ?=

.PHONY: setup lint test test-fast test-upstream demo

setup:
	bash tools/fork/setup_env.sh

lint: setup
	$(VENV)/bin/ruff check $(FORK_PY)
	$(VENV)/bin/ruff format --check $(FORK_PY)
	$(VENV)/bin/mypy $(FORK_PY)
	$(PY) tools/fork/check_spdx.py $(shell git ls-files)
	$(PY) tools/fork/check_results.py

# The suite runs in TEST_WORKERS processes, a test file to each in turn (the
# files' engines are shared by their tests); then, alone, the tests marked
# `serial`, which assert how soon a deadline fires. Exit status 5 ("nothing
# selected", e.g. by a -k in PYTEST_ARGS) is not a failure.
test: lint
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=40 $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest tests -m serial --durations=10 $(PYTEST_ARGS) || [ $$? -eq 5 ]
	bash tools/fork/upstream_tests.sh

# Upstream's tests, unmodified, against the fork; the reasoned exceptions are in
# tools/fork/upstream_tests_differ.txt.
test-upstream: setup
	bash tools/fork/upstream_tests.sh $(UPSTREAM_PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

demo: setup
	$(PY) examples/rl/rlhf_ipc_cpu_demo.py
