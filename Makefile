# The two commands of the README: `make demo` and `make test`.
# Each creates .venv and installs the project from this checkout first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test install slurm clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The study in miniature: digits, a small ResNet, 1, 2 and 4 emulated nodes x 2 replicas,
# allreduce vs sync vs mixed-async: a throughput bench, a learning study, one report.
DEMO      := runs/demo
DEMO_SETS := --set data.workers=0 --set cluster.gpus_per_node=2 --set optim.warmup_steps=0 --set train.eval_every=10
DEMO_GRID := --grid cluster.nodes=1,2,4 --grid strategy.name+cluster.num_ps=allreduce:0,sync:1,mixed-async:1

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/scaletrain bench --recipe recipes/digits.toml $(DEMO_SETS) $(DEMO_GRID) --warmup 5 --steps 30 --out $(DEMO)/bench
	$(BIN)/scaletrain study --recipe recipes/digits.toml $(DEMO_SETS) $(DEMO_GRID) --until epochs=12 --out $(DEMO)/study
	$(BIN)/scaletrain report $(DEMO)/bench $(DEMO)/study --out $(DEMO)/report

# Slurm and munge from Debian, for the tests that start an emulated 4-node cluster (root only).
slurm:
	command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || \
	{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge; }

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
