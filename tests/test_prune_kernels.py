"""2:4 sparse kernels: the cuSPARSELt / CUTLASS choice, the reason they cannot run on a CPU, and on an
Ampere-or-newer GPU a sparse linear layer and model equal to their dense 2:4 twins."""

import pytest
import torch

from labkit.models import tiny_llama
from labkit.prune import kernels, masks
from tests.prune_helpers import IDS, _logits, _model


@pytest.mark.parametrize("cusparselt, backend", [(True, "cusparselt"), (False, "cutlass")])
def test_2_4_kernels_fall_back_to_cutlass_without_cusparselt(monkeypatch, cusparselt, backend):
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    monkeypatch.setattr(torch.backends.cusparselt, "is_available", lambda: cusparselt)
    assert kernels.semi_structured_backend() == backend
    chosen = []
    for cls in (SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS):
        monkeypatch.setattr(cls, "from_dense", classmethod(lambda c, w: chosen.append(c) or w))
    kernels._semi_structured(torch.zeros(4, 4))
    assert chosen == [
        {"cusparselt": SparseSemiStructuredTensorCUSPARSELT, "cutlass": SparseSemiStructuredTensorCUTLASS}[backend]
    ]


def test_semi_structured_kernels_report_why_they_cannot_run_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the speed-up test runs instead")
    assert "NVIDIA GPUs only" in kernels.semi_structured_support("cpu")
    with pytest.raises(RuntimeError, match="NVIDIA GPUs only"):
        kernels.semi_structured_speedup(128, 128, 64, device="cpu")
    with pytest.raises(RuntimeError, match="NVIDIA GPUs only"):
        kernels.to_semi_structured(_model())


@pytest.mark.skipif(
    not torch.cuda.is_available() or kernels.semi_structured_support("cuda") is not None,
    reason="needs an Ampere-or-newer NVIDIA GPU",
)
def test_semi_structured_linear_matches_dense():
    result = kernels.semi_structured_speedup(1024, 1024, 256, repeats=3)
    assert result["max_abs_error"] < 0.5 and result["speedup"] > 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or kernels.semi_structured_support("cuda") is not None,
    reason="needs an Ampere-or-newer NVIDIA GPU",
)
def test_semi_structured_model_matches_its_dense_2_4_twin():
    model = tiny_llama(vocab_size=128, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    model = model.half().cuda()
    with pytest.raises(ValueError, match="not 2:4-sparse"):
        kernels.to_semi_structured(model)
    masks.nm_prune(model, 2, 4, permanent=True)
    ids = IDS.cuda()
    expected = _logits(model, ids)
    assert kernels.to_semi_structured(model) == 14
    torch.testing.assert_close(_logits(model, ids), expected, rtol=2e-2, atol=2e-2)
