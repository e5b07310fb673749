# Set-up and entry points. `make demo` and `make test` install everything they need first.
#
# PYTHON  the Python 3.12 to build on (default: python3.12 on PATH, else pyenv's 3.12).
# VENV    the virtual environment to create and install into (default .venv). With VENV empty
#         the targets use PYTHON as it is, install nothing from the network and only build this
#         package in place: for GPU machines with torch preinstalled and no registry, e.g.
#             make test PYTHON=python3 VENV=
VENV ?= .venv
# The first candidate that really runs as 3.12 (a pyenv shim on PATH may not).
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell for p in $$(ls -d $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3 \
	2>/dev/null) $$(command -v python3.12) $$(command -v python3); do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
	&& echo "$$p" && break; done)
endif
# Two pytest workers where pytest-xdist is installed (requirements.txt pins it); each file's
# tests stay on one worker, so a module's fixtures run once. Evaluated after the install.
PYTEST_ARGS ?= $(shell $(PY) -c 'import xdist' 2>/dev/null && echo '-n 2 --dist loadfile')

ifeq ($(strip $(VENV)),)
PY := $(PYTHON)
INSTALLED := build/.installed-system
else
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
endif

SOURCES := requirements.txt pyproject.toml setup.py $(wildcard csrc/*/*)

.PHONY: install test demo lint clean

install: $(INSTALLED)

$(INSTALLED): $(SOURCES)
	@test -n "$(PYTHON)" || { echo "No Python 3.12 found: install it or pass PYTHON=/path/to/python3.12"; exit 1; }
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || \
		{ echo "$(PYTHON) is not Python 3.12; pass PYTHON=/path/to/python3.12"; exit 1; }
ifeq ($(strip $(VENV)),)
	$(PY) -m pip install --no-index --no-build-isolation --no-deps -e .
else
	@# a new environment takes about 5 GB (torch's CUDA wheels): say so before pip runs out
	@test -x $(PY) || [ $$(df -Pk . | awk 'NR==2 {print $$4}') -ge 5000000 ] || \
		{ echo "make: a new $(VENV) needs about 5 GB free here (torch's CUDA wheels);" \
		"$$(df -Pk . | awk 'NR==2 {print int($$4 / 1024)}') MB are free"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
endif
	@mkdir -p $(dir $@) && touch $@

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# A tiny GPT on 2 CPU ranks (TP=2) learns a small text corpus while a soft error lands in its
# attention every 3 steps; ABFT corrects them all (pretrain/demo.py, configs/tiny_cpu.yaml).
demo: install
	$(PY) -m pretrain.demo

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf build *.egg-info .pytest_cache .hypothesis megatron_abft/_C*.so megatron_abft/_emulator*.so
