# The README's commands. Every target is idempotent: re-running skips what is done.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
NPROC ?= 2

# The main job's corpus: Debian's fortunes as JSON lines, then byte-tokenized .bin/.idx.
FORTUNES_DIR := /usr/share/games/fortunes
CORPUS := data/fortunes.jsonl
DATASET := data/fortunes_text_document
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup build test lint format coverage train bench clean corpus docs

# torch from PyPI (newest, CUDA build; it runs on CPU too), build tools, test tools,
# the extras (training; transformers for tpcore.hf, peft for its LoRA), then tpcore itself, editable,
# built against that torch (--no-build-isolation).
setup:
	$(PIP) install --quiet "torch>=2.4" numpy "scikit-build-core>=0.10" ninja "cmake>=3.18" pytest pytest-timeout pytest-xdist \
		pyyaml matplotlib safetensors tokenizers "transformers>=4.46" "peft>=0.21" $(LINTERS) $(DOCS_TOOLS)
	$(MAKE) build

# An editable install leaves the modules uncompiled (a wheel's install compiles them); where
# PYTHONDONTWRITEBYTECODE is set, every new interpreter (a torchrun worker, a launched rank)
# compiled them again: 0.4-0.9 s of CPU an `import tpcore, tpcore.train, tpcore.hf`.
build:
	$(PIP) install --quiet --no-build-isolation --editable .
	$(PYTHON) -m compileall -q python/tpcore

# Two pytest processes, a test module each at a time (--dist loadfile: a module's fixtures are
# made once): while one waits (on a timeout under test, a rank's start, a launched run's
# rendezvous) the other computes. One process left a fifth of the 2-core VM's CPU idle.
# --no-loadscope-reorder: the files start longest first (tests/run_order.py), not most tests
# first, so that no long file is left for one worker at the end.
TEST_WORKERS ?= 2
PYTEST_WORKERS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(PYTHON) -m pytest -q $(PYTEST_WORKERS)

# Linters, pinned so that every machine formats alike (settings in pyproject.toml and
# .clang-format). CI runs `make lint` before `make test`; `make format` fixes what it can.
LINTERS := ruff==0.17.6 clang-format==14.0.6
CXX_SOURCES = $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
CLANG_FORMAT = $(PYTHON) -c "import clang_format, sys; sys.argv[0] = 'clang-format'; sys.exit(clang_format.clang_format())"

# Line coverage of python/tpcore over the whole suite, the ranks it spawns and the runs it
# launches included; per package, then the uncovered lines of each file. The same two workers
# as `make test` (the workers are subprocesses, measured like the ranks). Not run by CI: 14 min
# 47 s on the 2-core VM on 2026-11-30, when a fresh clone's `make test` took 8-11.5 min.
coverage: setup
	$(PIP) install --quiet "coverage>=7.10"
	rm -rf build/coverage && mkdir -p build/coverage
	COVERAGE_FILE=$(CURDIR)/build/coverage/.coverage $(PYTHON) -m coverage run -m pytest -q $(PYTEST_WORKERS)
	COVERAGE_FILE=$(CURDIR)/build/coverage/.coverage $(PYTHON) -m coverage combine --quiet
	$(PYTHON) tools/coverage_report.py build/coverage/.coverage

lint:
	$(PIP) install --quiet $(LINTERS)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(CLANG_FORMAT) --dry-run --Werror $(CXX_SOURCES)

format:
	$(PIP) install --quiet $(LINTERS)
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
	$(CLANG_FORMAT) -i $(CXX_SOURCES)

# The main job: GPT pretraining, TP=2 on two CPU ranks (examples/gpt_small.yaml), from
# scratch each time; ends with a checkpoint, a loss-curve PNG and a generated sample.
train: setup corpus
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) examples/pretrain_gpt.py --config examples/gpt_small.yaml

corpus: $(DATASET).idx

$(FORTUNES_DIR):
	$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fortunes

$(CORPUS): | $(FORTUNES_DIR)
	$(PYTHON) examples/prepare_fortunes.py --source-dir $(FORTUNES_DIR) --output $@

$(DATASET).idx: $(CORPUS)
	$(PYTHON) -m tpcore.data.preprocess --input $(CORPUS) --output-prefix $(DATASET) --append-eod --workers $(NPROC)

# The docs site in build/site (mkdocs.yml): the README, docs/, benchmarks/README.md and an API
# page from the docstrings, built offline in strict mode (a broken link fails), pictures drawn
# by tools/build_docs.py from tpcore itself.
DOCS_TOOLS := mkdocs==1.6.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
docs: setup
	$(PYTHON) tools/build_docs.py
	$(PYTHON) -m mkdocs build --strict

bench: setup
	$(PYTHON) benchmarks/bench_linear.py

clean:
	rm -rf build dist python/tpcore/*.so data/fortunes* checkpoints/gpt_small
