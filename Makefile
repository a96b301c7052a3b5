# The two commands of the README: `make demo` and `make test`.
# Each creates .venv and installs the project from this checkout first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo demo-docs docs test test-quick install install-into-env slurm twin-tools clean gpu-bundle gpu-check

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Into a Python that already has torch (a CUDA build: a cluster's module, a conda env, an image),
# keeping that torch: its own version is a requirement pip finds met, so pip neither upgrades nor
# replaces it (constraints.txt's CPU pin is for this project's machines, and is not used here).
#   make install-into-env PY=/path/to/python [EXTRAS=torchvision|timm]
install-into-env:
	@v=$$($(PY) -c 'import torch; print(torch.__version__)' 2>/dev/null) || \
	  { echo "install-into-env: $(PY) has no torch that imports: install a build of torch in it first, or name the Python that has one (PY=...)"; exit 2; }; \
	echo "install-into-env: $(PY) keeps torch $$v"; \
	$(PY) -m pip install --disable-pip-version-check -e '.[test]' "torch==$$v"
ifdef EXTRAS
	@cmd=$$($(PY) -c 'import sys, torch; from scaletrain.models.factory import extra_command; \
	  print(extra_command(sys.argv[2:], torch.__version__, pip=sys.argv[1] + " -m pip"))' $(PY) $(EXTRAS)) && \
	  echo "$$cmd" && eval "$$cmd"
endif

# The study in miniature: digits, a small ResNet, 1, 2 and 4 emulated nodes x 2 replicas (on the
# CPUs, as the recipe says, even where there are GPUs: 4 nodes x 2 replicas would need 8 of them),
# allreduce vs sync vs mixed-async (and sync without the learning-rate rule, to show what it does):
# a throughput bench, a learning study, one report. The learning rate scales linearly with the
# images per update (optim.scale_lr), with a short warm-up, as Goyal et al.
# The bench emulates its GPUs (train.emulate_compute_s: each replica sleeps 0.1 s a step, then
# the strategies' real communication): on two shared cores real compute would leave no speedup to
# see. The learning study computes for real, each configuration until its test accuracy reaches
# 0.95 (at most 24 epochs), and reads its time to that on the bench's clock. Its last line is the
# same bench in the cluster twin (docs/twin.md), to run as root.
DEMO      := runs/demo
DEMO_SETS := --set data.workers=0 --set cluster.gpus_per_node=2 --set data.batch_size=16 \
             --set optim.scale_lr=linear --set optim.reference_batch=32 --set optim.warmup_steps=5 \
             --set train.eval_every=10
DEMO_GRID := --grid cluster.nodes=1,2,4 --grid strategy.name+cluster.num_ps=allreduce:0,sync:1,mixed-async:1
DEMO_RULE := --grid strategy.name+cluster.num_ps+optim.scale_lr=allreduce:0:linear,sync:1:linear,mixed-async:1:linear,sync:1:none

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/scaletrain bench --recipe recipes/digits.toml $(DEMO_SETS) --set train.emulate_compute_s=0.1 $(DEMO_GRID) --warmup 3 --steps 12 --out $(DEMO)/bench
	$(BIN)/scaletrain study --recipe recipes/digits.toml $(DEMO_SETS) --grid cluster.nodes=1,2,4 $(DEMO_RULE) --set train.steps=0 --set train.epochs=24 --until accuracy=0.95 --bench $(DEMO)/bench --out $(DEMO)/study
	$(BIN)/scaletrain report $(DEMO)/bench $(DEMO)/study --out $(DEMO)/report
	@echo "in the cluster twin (root): $(BIN)/scaletrain bench --recipe recipes/digits.toml $(DEMO_SETS) --set train.emulate_compute_s=0.1 $(DEMO_GRID) --warmup 3 --steps 12 --set cluster.network=netns --set cluster.link_gbps=1 --out $(DEMO)/bench-twin"

# The demo's page of the documentation: the tables of the last `make demo` (runs/demo), with the
# commit they ran at and the state of this checkout. Reads files only (no .venv needed).
demo-docs:
	$(PY) benchmarks/demo_tables.py --demo $(DEMO) --out docs/demo.md

# The documentation site: docs/ into site/ with mkdocs (the `docs` extra). --strict fails on any
# warning; mkdocs.yml makes a broken link or anchor one, and a test a page names that does not
# exist (docs/hooks/references.py). NO_MKDOCS_2_WARNING: the theme's banner about its successor.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Slurm and munge from Debian, for the tests that start an emulated 4-node cluster (root only).
slurm:
	command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || \
	{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge; }

# iproute2 (ip, tc) from Debian, for the cluster twin (cluster.network = netns; root only).
twin-tools:
	command -v ip >/dev/null && command -v tc >/dev/null || \
	{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; }

# The 20 slowest tests close its output: the suite is to stay well inside CI's 90 minutes. The
# checks of a minute or more each (marked `long`) run in benchmarks/long_tests.py instead.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not long" --durations=20

# The quick target: tests/unit (pure logic and single commands, seconds each; no cluster),
# 294 s for 578 tests on an idle two-core machine at 397f97c;
# `make test` runs everything but the `long` checks. Each folder of tests/ is a marker: pytest -m "dist or faults" works too.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The GPU tests (tests/gpu) and the benchmarks at ResNet-50 224 px, one JSON in benchmarks/results/;
# one line and nothing run without CUDA; at most 9 minutes on one GPU. PY_GPU=python3 uses a Python
# that already has a CUDA build of torch, with this checkout's src, instead of .venv: what else the
# check imports and that Python lacks comes from .gpu-bundle, with no package index, into .gpu-site
# (on PYTHONPATH behind src), and that Python's own packages are left as they are.
# `make gpu-bundle [GPU_PYTHON=3.12]` writes .gpu-bundle beforehand where pip reaches an index: those
# packages as wheels for the GPU machine's Python (default: this one's), no torch, at most 64 MiB.
GPU_BUNDLE := .gpu-bundle
GPU_SITE   := .gpu-site

gpu-bundle: $(STAMP)
	$(BIN)/python benchmarks/gpu_bundle.py write --out $(GPU_BUNDLE) $(if $(GPU_PYTHON),--python-version $(GPU_PYTHON))

ifdef PY_GPU
gpu-check:
	@$(PY_GPU) benchmarks/gpu_bundle.py install --bundle $(GPU_BUNDLE) --target $(GPU_SITE)
	@PYTHONPATH=$(CURDIR)/src:$(CURDIR)/$(GPU_SITE) $(PY_GPU) benchmarks/gpu_check.py
else
gpu-check: $(STAMP)
	@$(BIN)/python benchmarks/gpu_check.py
endif

clean:
	rm -rf $(VENV) runs site $(GPU_BUNDLE) $(GPU_SITE)
