# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PROTO := proto/dpu_offload/v1/agent.proto
# Wheels carried to the GPU machine, which reaches no registry (see docs/GPU.md).
WHEELS := pyzmq==27.3.0 grpcio==1.85.1 grpcio-health-checking==1.85.1 \
          grpcio-reflection==1.85.1 protobuf==7.36.2 etcd3gw futurist pbr requests urllib3 \
          idna charset-normalizer certifi debtcollector wrapt pytest-timeout \
          accelerate psutil py-spy

.PHONY: demo test test-arm64 fuzz reliability lint proto gpu-check bench wheels clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "make: cannot create $(VENV) (Debian: apt-get install python3-venv)" >&2; exit 1; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*; touch $@

demo: $(STAMP)
	$(PY) examples/demo.py
	dev=$$($(PY) -c 'from bench.run_all import gpu_count; print("cuda" if gpu_count() else "cpu")'); \
	$(PY) bench/decode.py --device $$dev --tokens 4 --layers 2 --experts 16 \
	  --gpu-cache-fraction 0.25 0.5 --no-save

test: $(STAMP)
	bash scripts/ensure_tools.sh
	$(PY) -m pytest -m "not gpu" -q

# The agent as an aarch64 process under qemu-aarch64, the x86 host client against it.
test-arm64: $(STAMP)
	bash scripts/arm64_env.sh
	DPU_TEST_ARM64=1 $(PY) -m pytest -q tests/arm64
	$(PY) bench/arm64.py

# At least 10,000 examples per fuzz target, bounded to 30 minutes.
fuzz: $(STAMP)
	set -o pipefail; HYPOTHESIS_PROFILE=fuzz timeout 1800 $(PY) -m pytest -q --timeout 1800 tests/fuzz tests/test_engine_plan.py \
	  --hypothesis-show-statistics 2>&1 | tee bench/results/fuzz.log

# docs/RELIABILITY.md from the fault tests (run now), the last fuzz log and load results.
reliability: $(STAMP)
	bash scripts/ensure_tools.sh
	$(PY) bench/reliability_report.py

lint: $(STAMP)
	$(PY) -m ruff check .

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTO)

# On the GPU machine: system python3 (CuPy, torch, grpcio there) plus carried wheels.
gpu-check:
	bash scripts/gpu_check.sh

bench: $(STAMP)
	bash scripts/ensure_tools.sh
	$(PY) bench/run_all.py

wheels:
	rm -rf .whl && $(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: \
	  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(WHEELS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
