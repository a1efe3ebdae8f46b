# The README's two commands are `make serve` and `make test`; everything else is a helper.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: install proto serve lint test test-slow test-all bench clean

install:
	scripts/install.sh

proto: install

serve: install
	$(VENV)/bin/tiercache serve

lint: install
	$(VENV)/bin/ruff check tiercache tests benchmarks

test: install lint
	$(PYTEST) -q -m "not slow and not gpu"

test-slow: install
	$(PYTEST) -q -m "slow and not gpu"

test-all: test test-slow

bench: install
	$(PY) benchmarks/put_get.py

clean:
	rm -rf $(VENV) tiercache/_proto/*_pb2*.py .pytest_cache
