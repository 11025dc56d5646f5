# make run  — serve the default model (bootstraps .venv on first use)
# make test — the test suite (CPU; GPU tests skip without CUDA)
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU machines: the CPU wheel (on disk here). GPU machines: TORCH="torch" or a preinstalled torch.
TORCH  ?= torch==2.13.0
PROTOS := $(wildcard proto/tandem/v1/*.proto)

.PHONY: run test install install-test proto clean compose-check
# what serving needs (make run); the test tools come on top (make test)
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
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
