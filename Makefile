# `make demo` and `make test` work on a fresh clone: both create .venv first.
# The install says what it is doing and shows pip's download progress: the CPU build of
# torch is a ~200 MB download, the whole install takes one to three minutes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check --no-input
PIPI   := $(PIP) install --progress-bar on -c constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean venv cli

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "==> [1/4] creating the virtual environment $(VENV)/ with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(PIP) install --progress-bar on --upgrade pip
	@echo "==> [3/4] installing torch 2.13.0, CPU build (~200 MB download, about a minute)"
	$(PIPI) torch==2.13.0
	@echo "==> [4/4] installing nantrace (editable) with its extras: lightning, transformers, tensorboard, plotly, pytest"
	$(PIPI) -e ".[all,dev]"
	touch $(STAMP)
	@echo "==> done. The nantrace command is $(VENV)/bin/nantrace (or: source $(VENV)/bin/activate; nantrace --help)"

demo: $(STAMP)
	$(VENV)/bin/nantrace demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# Where the installed command is, and what it can do.
cli: $(STAMP)
	@echo "The nantrace command: $(VENV)/bin/nantrace   (or run 'source $(VENV)/bin/activate' once, then 'nantrace')"
	@$(VENV)/bin/nantrace --help

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
