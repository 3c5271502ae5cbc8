"""labkit.lora: LoRALinear from scratch in exact parity with PEFT, merging, adapters saved and loaded."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit import lora, quant
from labkit.models import count_parameters, tiny_llama


@pytest.fixture
def ids():
    return torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def randomize_b(model: torch.nn.Module) -> None:
    """B starts at zero (the adapter starts as a no-op); give it values so that every path is exercised."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_a_fresh_adapter_leaves_the_output_unchanged_and_trains_only_a_and_b():
    base = torch.nn.Linear(32, 16)
    layer = lora.LoRALinear(copy.deepcopy(base), r=4, alpha=8)
    x = torch.randn(5, 32)
    assert torch.equal(layer(x), base(x))
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    assert layer.lora_A.shape == (4, 32) and layer.lora_B.shape == (16, 4) and layer.scaling == 2


@pytest.mark.parametrize("kwargs", [{"r": 0}, {"r": 2.5}, {"dropout": 1.0}])
def test_lora_linear_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        lora.LoRALinear(torch.nn.Linear(4, 4), **kwargs)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), lora.ALL_LINEAR])
def test_from_scratch_matches_peft_outputs_and_gradients(ids, targets):
    ours, theirs = tiny_llama(), tiny_llama()
    lora.add_lora(ours, targets, r=4, alpha=8)
    peft_model = lora.apply_peft(theirs, targets, r=4, alpha=8)
    randomize_b(peft_model)
    lora.copy_from_peft(peft_model, ours)
    out_ours, out_theirs = ours(ids, labels=ids), peft_model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_ours.logits, out_theirs.logits, rtol=0, atol=1e-6)
    out_ours.loss.backward()
    out_theirs.loss.backward()
    grads_theirs = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
                    for n, p in peft_model.named_parameters() if p.requires_grad}
    grads_ours = {n.replace("lora_A", "lora_A.weight").replace("lora_B", "lora_B.weight"): p.grad
                  for n, p in ours.named_parameters() if p.requires_grad}
    grads_theirs = {n.replace(".base_layer", ""): g for n, g in grads_theirs.items()}
    assert grads_ours.keys() == grads_theirs.keys()
    for name in grads_ours:
        torch.testing.assert_close(grads_ours[name], grads_theirs[name], rtol=1e-5, atol=1e-7)


def test_only_adapter_parameters_receive_gradients(ids):
    model = tiny_llama()
    adapters = lora.add_lora(model, lora.ALL_LINEAR, r=2)
    model(ids, labels=ids).loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * 7  # q k v o gate up down in each of 2 layers; the LM head is left out
    trainable = count_parameters(model, trainable_only=True)
    assert trainable == sum(2 * (m.base.in_features + m.base.out_features) for m in adapters.values())


def test_merged_model_gives_the_same_outputs_as_ours_and_as_peft(ids):
    ours, theirs = tiny_llama(), tiny_llama()
    lora.add_lora(ours, ("q_proj", "v_proj", "down_proj"), r=4, alpha=8)
    peft_model = lora.apply_peft(theirs, ("q_proj", "v_proj", "down_proj"), r=4, alpha=8)
    randomize_b(peft_model)
    lora.copy_from_peft(peft_model, ours)
    with torch.no_grad():
        before = ours(ids).logits
        lora.merge_lora(ours)
        assert not any(isinstance(m, lora.LoRALinear) for m in ours.modules())
        torch.testing.assert_close(ours(ids).logits, before, rtol=0, atol=1e-5)
        torch.testing.assert_close(peft_model.merge_and_unload()(ids).logits, before, rtol=0, atol=1e-5)


def test_adapter_save_and_load_round_trip(ids, tmp_path):
    peft_model = lora.apply_peft(tiny_llama(), ("q_proj", "v_proj"), r=4)
    randomize_b(peft_model)
    path = lora.save_adapter(peft_model, tmp_path / "adapter")
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    loaded = lora.load_adapter(tiny_llama(), path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, peft_model(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load_adapter(tiny_llama(), tmp_path)


def test_unknown_targets_list_the_available_names():
    with pytest.raises(ValueError, match=r"\['qkv'\].*available: \['down_proj', 'gate_proj', 'k_proj', 'o_proj'"):
        lora.add_lora(tiny_llama(), ("q_proj", "qkv"))
    with pytest.raises(ValueError, match="available"):
        lora.apply_peft(tiny_llama(), ("attn",))
    with pytest.raises(ValueError, match="non-empty"):
        lora.resolve_targets(tiny_llama(), [])


def test_lora_on_a_quantized_base_trains_only_the_adapters(ids):
    """QLoRA-style: the frozen base holds lab 07's quantized weights; the adapters train in fp32."""
    qm = quant.quantize_model(tiny_llama(), quant.QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    model = qm.model
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.add_lora(model, lora.ALL_LINEAR, r=4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = model(ids, labels=ids).loss
    for _ in range(5):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    assert model(ids, labels=ids).loss < first
    for name, q in qm.weights.items():  # the quantized base is untouched
        assert torch.equal(model.get_submodule(name).base.weight, q.dequantize())
    frozen = {n.replace(".base.", "."): p for n, p in model.named_parameters() if "lora_" not in n}
    assert frozen.keys() == base.keys() and all(torch.equal(p, base[n]) for n, p in frozen.items())


@pytest.mark.model
def test_default_model_q_v_rank_8_trains_a_third_of_a_percent(default_model):
    model, _ = default_model
    model = copy.deepcopy(model)
    lora.add_lora(model, ("q_proj", "v_proj"), r=8)
    trainable, total = count_parameters(model, trainable_only=True), count_parameters(model)
    assert trainable == 30 * 8 * ((576 + 576) + (576 + 192))  # 460,800, PEFT's count on SmolLM2
    assert trainable / total < 0.004
