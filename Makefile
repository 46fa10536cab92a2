VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv serve test clean

venv: $(STAMP)

# torch first, pinned: the CPU wheel lies on disk; an unpinned torch would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# OMP_WAIT_POLICY must be in the environment before torch loads (see docs/architecture.md).
serve: venv
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/hypercorn trio_infer.app:app --worker-class trio --bind 127.0.0.1:8000

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
