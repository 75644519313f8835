# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch/torchvision pinned to the pair that installs from this machine class's local wheel cache
	$(BIN)/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -e '.[all,test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/cgavit demo

# the tests run every export format: LiteRT too, which [all] leaves out (about 0.9 GB; BENCHMARKS.md).
# torch is named again so that pip keeps it (litert-torch 0.9.4 allows torch < 2.14, 0.8.0 < 2.10), and
# cattrs below 26, the last that accepts the typing-extensions < 4.13 that LiteRT's xdsl pins
$(VENV)/.installed-test: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[tflite]' torch==2.14.1 torchvision==0.29.1 'cattrs<26'
	touch $@

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) .pytest_cache
