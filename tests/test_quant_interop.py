"""labkit.quant.interop: GPTQModel and transformers on the library side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.models import tiny_llama
from labkit.quant import interop
from labkit.quant.formats import QuantConfig
from labkit.quant.gptq_format import load_gptq, save_gptq, unpack_weight
from labkit.quant.interop import gptq_kernels, gptqmodel_available, load_with_transformers, quantize_with_gptqmodel
from labkit.quant.whole_model import quantize_model
from labkit.torchutil import quiet

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.slow
@pytest.mark.skipif(not gptqmodel_available(), reason="GPTQModel and optimum are not installed")
@pytest.mark.parametrize("bits", [3, 4])
def test_a_labkit_checkpoint_loads_through_transformers(tiny, calibration, tmp_path, bits):
    qm = quantize_model(tiny, QuantConfig(bits=bits, group_size=32), calibration, progress=False)
    save_gptq(qm, None, tmp_path / "q")
    hf = load_with_transformers(tmp_path / "q")
    module = hf.model.layers[1].mlp.down_proj
    assert type(module).__module__.startswith("gptqmodel")  # a packed kernel, not a dense nn.Linear
    # every decoder linear (7 per block) runs one CPU kernel: ATen's int4 matmul, or plain torch for 3 bits
    kernel = {4: "TorchAtenLinear (gptq_torch_aten)", 3: "TorchLinear (gptq_torch)"}[bits]
    assert gptq_kernels(hf) == {kernel: 7 * hf.config.num_hidden_layers}
    theirs = unpack_weight(
        {k: getattr(module, k) for k in ("qweight", "qzeros", "scales", "g_idx")}, bits, module.in_features, v1=False
    )  # GPTQModel converts to v2 on load
    ours = qm.weights["model.layers.1.mlp.down_proj"]
    assert torch.equal(theirs.codes, ours.codes) and torch.equal(theirs.zeros, ours.zeros)
    ids = calibration[:2]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), qm.model(ids).logits, rtol=0, atol=0.03)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(not gptqmodel_available(), reason="GPTQModel and optimum are not installed")
def test_a_labkit_checkpoint_loads_in_gptqmodel_itself(tiny, calibration, tmp_path):
    from labkit.models import load_tokenizer

    qm = quantize_model(tiny, QuantConfig(bits=4, group_size=32), calibration, progress=False)
    save_gptq(qm, load_tokenizer(), tmp_path / "q")  # GPTQModel insists on a tokenizer
    with quiet("GPTQModel.load"):
        from gptqmodel import GPTQModel

        loaded = GPTQModel.load(str(tmp_path / "q"), device="cpu")
    ids = calibration[:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits.float(), qm.model(ids).logits, rtol=0, atol=0.03)


def test_loading_through_transformers_without_gptqmodel_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(interop, "gptqmodel_available", lambda: False)
    with pytest.raises(ImportError, match=r"labkit\[gptq\]"):
        load_with_transformers(tmp_path)


@pytest.mark.parametrize("chosen", [None, "3"])
def test_the_gptqmodel_environment_lasts_for_the_call_only(monkeypatch, chosen):
    """GPTQModel gets at most 4 CPU workers unless the user chose a number; afterwards the environment is the
    caller's again, also the variables that importing GPTQModel sets for good (HF_HOME through tokenicer...)."""
    if chosen is None:
        monkeypatch.delenv("GPTQMODEL_CPU_WORKERS", raising=False)
    else:
        monkeypatch.setenv("GPTQMODEL_CPU_WORKERS", chosen)
    monkeypatch.setenv("HF_HOME", "/home/student/hf")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="in the call"), interop._gptqmodel_environ():
        workers = os.environ["GPTQMODEL_CPU_WORKERS"]
        assert workers == chosen if chosen else workers == str(min(os.cpu_count() or 1, 4))
        os.environ["HF_HOME"] = "/tmp/tokenicer_hf_home"  # what importing GPTQModel 7.6 does
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
        raise RuntimeError("in the call")
    assert dict(os.environ) == before


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(not gptqmodel_available(), reason="GPTQModel and optimum are not installed")
def test_quantizing_with_gptqmodel_matches_the_fixture_and_leaves_no_trace(tmp_path, monkeypatch):
    """The recipe of tests/fixtures/make_gptqmodel_tiny.py, run from an empty working directory: GPTQModel
    writes its run log elsewhere (it would create logs/ here) and the environment is the caller's again."""
    from labkit.models import load_tokenizer

    model = tiny_llama()
    generator = torch.Generator().manual_seed(0)
    calibration = torch.randint(2, model.config.vocab_size, (16, 64), generator=generator)
    model.save_pretrained(tmp_path / "fp32")
    load_tokenizer().save_pretrained(tmp_path / "fp32")  # GPTQModel insists on a tokenizer
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv("GPTQMODEL_CPU_WORKERS", raising=False)
    before = dict(os.environ)
    dest = quantize_with_gptqmodel(
        tmp_path / "fp32", calibration, QuantConfig(bits=4, group_size=32, damp=0.05), tmp_path / "q"
    )
    assert list((tmp_path / "cwd").iterdir()) == []
    assert dict(os.environ) == before
    from gptqmodel.looper import loop_processor  # imported after the call: its import-time variables are checked too

    assert loop_processor._PROJECT_LOG_DIR == Path("logs")  # GPTQModel's own setting, back for its other callers
    ours, shipped = load_gptq(dest), load_gptq(FIXTURES / "gptqmodel_tiny")
    for name, q in shipped.weights.items():
        assert torch.equal(ours.weights[name].codes, q.codes), name


def _stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stderr


@pytest.mark.skipif(not interop.bitsandbytes_available(), reason="bitsandbytes is not installed")
def test_bitsandbytes_imports_without_its_hub_kernel_warning():
    plain = _stderr_of("import bitsandbytes")
    if "kernels-community" not in plain:
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes logs no hub-kernel warning to hold back")
    ours = _stderr_of(
        "import logging; from labkit.quant import import_bitsandbytes; import_bitsandbytes(); "
        "assert logging.getLogger('bitsandbytes.backends.cpu.ops').level == logging.NOTSET"  # left as it was
    )
    assert "kernels-community" not in ours
