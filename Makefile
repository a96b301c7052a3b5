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

demo: $(STAMP)
	rm -rf runs/demo-digits
	$(BIN)/scaletrain train --recipe recipes/digits.toml --run-dir runs/demo-digits

# Slurm and munge from Debian, for the tests that start an emulated 4-node cluster (root only).
slurm:
	command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null || \
	{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge; }

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
