# Developer and CI entry points. Everything runs from the project venv that `make venv`
# creates (scripts/setup_venv.sh: idempotent, returns at once when nothing changed).
#
#   make serve HTTP_PORT=8100   # serve model_repository with Triton (and the OpenAI API on :9000);
#                               # or ORCA_HTTP_PORT=8100 make serve (the command line wins over the environment)
#   make test PYTEST_ARGS='-k launcher -x'
#   make test-stress            # full-size reliability runs (tests/reliability, marker stress): 1,000-request
#                               # soak and 200-stream cancellation storm on SmolLM2; figures to docs/reliability/

PYTHON ?= python3
VENV ?= .venv
MODEL_REPOSITORY ?= model_repository
# Ports. Left empty, the launcher picks each (the one place they have defaults): ORCA_HTTP_PORT,
# ORCA_GRPC_PORT, ORCA_METRICS_PORT, ORCA_OPENAI_PORT from the environment, else 8000/8001/8002/9000;
# one given here (make serve HTTP_PORT=8100) wins over the environment. OPENAI_PORT is the
# OpenAI-compatible API (orca-openai) beside Triton; OPENAI_PORT=0 starts none.
HTTP_PORT ?=
GRPC_PORT ?=
METRICS_PORT ?=
OPENAI_PORT ?=
SERVE_ARGS ?=
PYTEST_ARGS ?=

VPY := $(VENV)/bin/python

.PHONY: venv serve test test-gpu gpu-check test-stress lint

venv:
	PYTHON="$(PYTHON)" VENV_DIR="$(VENV)" bash scripts/setup_venv.sh

serve: venv
	$(VPY) -m orca_server.launcher --model-repository $(MODEL_REPOSITORY) \
		$(if $(HTTP_PORT),--http-port $(HTTP_PORT)) $(if $(GRPC_PORT),--grpc-port $(GRPC_PORT)) \
		$(if $(METRICS_PORT),--metrics-port $(METRICS_PORT)) $(if $(OPENAI_PORT),--openai-port $(OPENAI_PORT)) \
		$(SERVE_ARGS)

# Any non-zero pytest exit fails the target: 1 for failures, 5 when no test was collected.
test: venv
	@rc=0; $(VPY) -m pytest -q $(PYTEST_ARGS) tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

# The engine on CUDA (tests/test_gpu.py); every test is skipped where torch sees no GPU.
test-gpu: venv
	$(VPY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

# The whole GPU verification in one run (scripts/gpu_check.py): environment and ceilings, test-gpu, the
# decode sweep against transformers and the roofline, the offline engine. Installs nothing (a bare GPU
# machine has no registry): $PYTHON, else .venv's python, else python3. OUT=dir (default gpu_check_out).
gpu-check:
	bash scripts/gpu_check.sh $(OUT)

# The reliability suite at full size (tests/reliability, docs/RELIABILITY.md) against the shipped SmolLM2
# orca_gpt; `make test` runs the same tests at CI size on tiny models and skips these. Sizes:
# ORCA_STRESS_SOAK_REQUESTS, ORCA_STRESS_SOAK_RATE, ORCA_STRESS_STORM_STREAMS. Figures (JSON, the soak's
# RSS curve) go to RELIABILITY_REPORT_DIR.
RELIABILITY_REPORT_DIR ?= docs/reliability
test-stress: venv
	ORCA_RELIABILITY_REPORT_DIR="$(RELIABILITY_REPORT_DIR)" $(VPY) -m pytest -q -s -m stress $(PYTEST_ARGS) tests/reliability

lint: venv
	$(VENV)/bin/ruff check .
