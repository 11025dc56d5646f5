# make run  — serve the default model (bootstraps .venv on first use)
# make test — the test suite (CPU; GPU tests skip without CUDA)
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch by machine, whatever pip's configuration: without an NVIDIA GPU the CPU build (2.13.0+cpu, from
# PyTorch's CPU index or a local wheel), checked after install; with one, PyPI's CUDA build. TORCH=... overrides.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH  ?= torch==2.13.0
TORCH_PIP ?=
else
TORCH  ?= torch==2.13.0+cpu
TORCH_PIP ?= --extra-index-url https://download.pytorch.org/whl/cpu --retries 1
endif
PROTOS := $(wildcard proto/tandem/v1/*.proto)

.PHONY: run test install install-test proto clean compose-check
# what serving needs (make run); the test tools come on top (make test)
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps $(TORCH_PIP) "$(TORCH)"
	$(PY) -m pip install -q "$(TORCH)"
	@test "$(HAS_GPU)" = 1 || $(PY) -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else \
		'make: a CUDA build of torch (' + torch.__version__ + ') is in $(VENV) on a machine without an NVIDIA GPU; ' \
		'remove $(VENV) and run again with TORCH=\"torch==<version>+cpu\"')"
	$(PY) -m pip install -q -e .
	touch $@

install-test: $(VENV)/.installed-test
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

proto: tandem/v1/.generated
tandem/v1/.generated: $(PROTOS) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch $@

run: install proto
	$(PY) -m tandem serve $(ARGS)

test: install-test proto
	$(PY) -m pytest -q tests $(ARGS)

# validate the compose files (Debian: apt-get install docker-compose; .ci/run installs it)
compose-check:
	docker-compose -f docker-compose.yml config -q
	docker-compose -f docker-compose.yml -f docker-compose.gpu.yml config -q

clean:
	rm -rf $(VENV) tandem/v1/*_pb2*.py tandem/v1/*_pb2*.pyi tandem/v1/.generated
