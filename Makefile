# The two commands of the README: `make demo` and `make test`.
# Each bootstraps a local virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.streamkv-installed
OUT    ?= out

.PHONY: demo test venv clean

venv: $(STAMP)

# torch is pinned here (not in pyproject) so the bootstrap takes the CPU wheel
# instead of resolving a multi-GB CUDA build; the package itself declares a range.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps flashdreams==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/streamkv demo --out $(OUT)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .hypothesis
