# The README's commands. Every target is idempotent: re-running skips what is done.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
NPROC ?= 2

.PHONY: setup build test train bench clean

# torch from PyPI (newest, CUDA build; it runs on CPU too), build tools, test tools,
# then tpcore itself, editable, built against that torch (--no-build-isolation).
setup:
	$(PIP) install --quiet "torch>=2.4" numpy "scikit-build-core>=0.10" ninja "cmake>=3.18" pytest pytest-timeout
	$(MAKE) build

build:
	$(PIP) install --quiet --no-build-isolation --editable .

test: setup
	$(PYTHON) -m pytest -q

# The main job (for now a demo; "GPT pretraining" replaces it): two ranks run a
# column -> GeLU -> row MLP and check it against the dense MLP.
train: setup
	$(PYTHON) -m torch.distributed.run --nproc_per_node $(NPROC) examples/mlp_demo.py

bench: setup
	$(PYTHON) benchmarks/bench_linear.py

clean:
	rm -rf build dist python/tpcore/*.so
