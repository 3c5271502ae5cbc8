"""labkit.lora: LoRALinear from scratch in exact parity with PEFT, merging, adapters saved and loaded, and the memory
arithmetic of fine-tuning a model too large to build here."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from labkit import lora, tasks, train
from labkit.models import PUBLISHED_SHAPES, DecoderShape, count_parameters, tiny_llama
from labkit.quant.formats import QuantConfig
from labkit.quant.packed import pack_model
from labkit.quant.whole_model import quantize_model
from tests.numerics import FLOAT64
from tests.permissions import UMASK_CASES, modes, umask


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


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in the logits' own dtype."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def train_a_few_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int = 5) -> bool:
    """AdamW on whatever is trainable; True when the loss went down."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = model(ids, labels=ids).loss.item()
    for _ in range(steps):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    return model(ids, labels=ids).loss.item() < first


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
    environment = dict(os.environ)
    peft_model = lora.apply_peft(theirs, targets, r=4, alpha=8)
    assert dict(os.environ) == environment  # importing peft (and GPTQModel with it) sets HF_HOME and more for good
    randomize_b(peft_model)
    assert lora.adapter_difference(peft_model, ours) > 0  # independent random A
    lora.copy_from_peft(peft_model, ours)
    assert lora.adapter_difference(peft_model, ours) == 0.0
    ours.double()  # two implementations: compared where rounding cannot hide a mistake
    peft_model.double()
    out_ours, out_theirs = ours(ids).logits, peft_model(input_ids=ids).logits
    assert out_ours.dtype == torch.float64
    torch.testing.assert_close(out_ours, out_theirs, **FLOAT64)
    next_token_loss(out_ours, ids).backward()  # in float64 (transformers' own loss casts logits to fp32)
    next_token_loss(out_theirs, ids).backward()
    grads_theirs = {
        n.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for n, p in peft_model.named_parameters()
        if p.requires_grad
    }
    grads_ours = {
        n.replace("lora_A", "lora_A.weight").replace("lora_B", "lora_B.weight"): p.grad
        for n, p in ours.named_parameters()
        if p.requires_grad
    }
    grads_theirs = {n.replace(".base_layer", ""): g for n, g in grads_theirs.items()}
    assert grads_ours.keys() == grads_theirs.keys()
    for name in grads_ours:
        torch.testing.assert_close(grads_ours[name], grads_theirs[name], **FLOAT64)


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
    ours.double()  # W + s·BA against Wx + s·B(Ax): equal in exact arithmetic only
    peft_model.double()
    with torch.no_grad():
        before = ours(ids).logits
        lora.merge_lora(ours)
        assert not any(isinstance(m, lora.LoRALinear) for m in ours.modules())
        torch.testing.assert_close(ours(ids).logits, before, **FLOAT64)
        torch.testing.assert_close(peft_model.merge_and_unload()(ids).logits, before, **FLOAT64)


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


def test_adapters_trained_from_scratch_ship_as_a_peft_adapter(ids, tmp_path):
    ours = tiny_llama()
    lora.add_lora(ours, ("q_proj", "v_proj"), r=4)
    randomize_b(ours)
    peft_model = lora.apply_peft(tiny_llama(), ("q_proj", "v_proj"), r=4)
    lora.copy_to_peft(ours, peft_model)
    loaded = lora.load_adapter(tiny_llama(), lora.save_adapter(peft_model, tmp_path / "adapter"))
    loaded.double()  # PEFT's layers against ours, on the very same (saved and reloaded) values
    ours.double()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours(ids).logits, **FLOAT64)
    with pytest.raises(ValueError, match="LoRALinear"):
        lora.copy_to_peft(tiny_llama(), peft_model)  # no adapters on this side


def test_unknown_targets_list_the_available_names():
    with pytest.raises(ValueError, match=r"\['qkv'\].*available: \['down_proj', 'gate_proj', 'k_proj', 'o_proj'"):
        lora.add_lora(tiny_llama(), ("q_proj", "qkv"))
    with pytest.raises(ValueError, match="available"):
        lora.apply_peft(tiny_llama(), ("attn",))
    with pytest.raises(ValueError, match="non-empty"):
        lora.resolve_targets(tiny_llama(), [])


def test_lora_on_a_quantized_base_trains_only_the_adapters(ids):
    """QLoRA-style: the frozen base holds lab 07's quantized weights; the adapters train in fp32."""
    qm = quantize_model(tiny_llama(), QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    model = qm.model
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.add_lora(model, lora.ALL_LINEAR, r=4)
    assert train_a_few_steps(model, ids)  # the loss went down
    for name, q in qm.weights.items():  # the quantized base is untouched
        assert torch.equal(model.get_submodule(name).base.weight, q.dequantize())
    frozen = {n.replace(".base.", "."): p for n, p in model.named_parameters() if "lora_" not in n}
    assert frozen.keys() == base.keys() and all(torch.equal(p, base[n]) for n, p in frozen.items())


def test_lora_on_a_packed_4_bit_base_trains_and_merges(ids):
    """QLoRA proper: the base stays packed (4 bits per weight) while the fp32 adapters train on top."""
    qm = quantize_model(tiny_llama(), QuantConfig(bits=4, group_size=32), method="rtn", progress=False)
    model = pack_model(qm)
    packed = {n: b.clone() for n, b in model.named_buffers() if n.endswith(".packed")}
    adapters = lora.add_lora(model, ("q_proj", "down_proj"), r=4)
    assert {type(a.base).__name__ for a in adapters.values()} == {"PackedLinear"}
    assert train_a_few_steps(model, ids)  # the loss went down
    after = {n.replace(".base.", "."): b for n, b in model.named_buffers() if n.endswith(".packed")}
    assert after.keys() == packed.keys() and all(torch.equal(b, packed[n]) for n, b in after.items())
    with torch.no_grad():
        unmerged = model(ids).logits
        merged = lora.merge_lora(model)(ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)


def test_qlora_from_scratch_trains_as_peft_on_bitsandbytes_4bit(ids):
    """QLoRA as practitioners run it (PEFT adapters on every linear of a bitsandbytes NF4 model) against labkit's
    LoRALinear on NF4Linear layers holding the same codes: same outputs, and the same adapters after AdamW steps."""
    pytest.importorskip("bitsandbytes")
    from labkit.quant.interop import from_bnb_4bit, to_bnb_4bit

    theirs = to_bnb_4bit(tiny_llama())
    ours = from_bnb_4bit(copy.deepcopy(theirs))
    lora.add_lora(ours, lora.ALL_LINEAR, r=4, alpha=8)
    peft_model = lora.apply_peft(theirs, lora.ALL_LINEAR, r=4, alpha=8)
    assert {type(m.base).__name__ for m in ours.modules() if isinstance(m, lora.LoRALinear)} == {"NF4Linear"}
    randomize_b(peft_model)
    lora.copy_from_peft(peft_model, ours)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, peft_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    start = {n: p.detach().clone() for n, p in ours.named_parameters() if p.requires_grad}
    packed = {n: b.clone() for n, b in ours.named_buffers()}
    for model in (ours, peft_model):
        assert train_a_few_steps(model, ids, steps=3)
    assert all(not torch.equal(p, start[n]) for n, p in ours.named_parameters() if p.requires_grad)
    assert lora.adapter_difference(peft_model, ours) < 1e-5  # measured: 0.0, the same arithmetic on the same codes
    assert all(torch.equal(b, packed[n]) for n, b in ours.named_buffers())  # the 4-bit base never moves


def test_update_spectrum_and_energy_rank_see_a_low_rank_update():
    torch.manual_seed(0)
    before = torch.randn(40, 30)
    u, v = torch.randn(40, 2), torch.randn(2, 30)
    s = lora.update_spectrum(before, before + u @ v)
    assert s.shape == (30,) and (s[:2] > 1).all() and (s[2:] < 1e-4).all()
    assert lora.energy_rank(torch.tensor([4.0, 3.0, 0.0])) == 2  # 16 + 9 of 25: 90 % needs both
    assert lora.energy_rank(torch.tensor([4.0, 3.0, 0.0]), share=0.5) == 1
    with pytest.raises(ValueError):
        lora.update_spectrum(before, before[:, :5])
    with pytest.raises(ValueError):
        lora.energy_rank(s, share=0)


def test_truncated_updates_keep_the_best_rank_r_part_of_the_change_then_restore():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 40))
    before = {"0.weight": model[0].weight.detach().clone()}
    delta = torch.randn(40, 2) @ torch.randn(2, 30) + 0.01 * torch.randn(40, 30)
    with torch.no_grad():
        model[0].weight += delta
        model[0].bias += 1
    trained = model[0].weight.detach().clone()
    u, s, vh = torch.linalg.svd(delta)
    seen = []
    for r in lora.truncated_updates(model, before, (1, 2)):
        expected = (u[:, :r] * s[:r]) @ vh[:r]
        torch.testing.assert_close(model[0].weight - before["0.weight"], expected, atol=1e-5, rtol=1e-4)
        seen.append(r)
    assert seen == [1, 2] and torch.equal(model[0].weight, trained)  # the trained weights are back
    with pytest.raises(ValueError, match="2-D"):
        next(lora.truncated_updates(model, {"0.bias": model[0].bias.detach()}, (1,)))
    with pytest.raises(ValueError, match="positive"):
        next(lora.truncated_updates(model, before, (0,)))


def test_training_state_counts_gradients_and_two_adam_moments_for_trainable_weights_only():
    model = tiny_llama()
    full = lora.training_state_bytes(model)
    assert full["gradients"] == 4 * count_parameters(model) and full["optimizer"] == 2 * full["gradients"]
    adapters = lora.add_lora(model, ("q_proj",), r=4)
    adapted = lora.training_state_bytes(model)
    a = next(iter(adapters.values()))
    assert adapted["gradients"] == 4 * len(adapters) * 4 * (a.base.in_features + a.base.out_features)
    assert adapted["weights"] == full["weights"] + adapted["gradients"]  # the base plus the adapters
    assert adapted["total"] == adapted["weights"] + 3 * adapted["gradients"]


def test_adapter_params_of_llama_2_7b_by_hand():
    llama = PUBLISHED_SHAPES["Llama-2-7B"]
    assert lora.adapter_params(llama, 8) == 4_194_304  # 32 layers × r 8 × (q: 4096 + 4096, v: 4096 + 4096)
    assert lora.adapter_params(llama, 64, lora.ALL_LINEAR) == 159_907_840  # 32 × 64 × (4 × 8192 + 3 × 15104)


@pytest.mark.parametrize("tied", [True, False])
def test_adapter_params_count_what_add_lora_trains(tied):
    # grouped-query attention: k and v project 16 inputs to 2 heads × 4 = 8 outputs
    shape = DecoderShape(100, 16, 2, num_heads=4, num_kv_heads=2, intermediate_size=40, tie_word_embeddings=tied)
    model = tiny_llama(**dataclasses.asdict(shape))
    linears = [model.get_submodule(n).weight.numel() for n in lora.linear_names(model)]
    assert shape.linear_params == sum(linears) == 2 * (2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 40) == 5376
    for targets, r, hand in ((("q_proj", "v_proj"), 4, 2 * 4 * (32 + 24)), (lora.ALL_LINEAR, 2, 2 * 2 * 280)):
        adapted = copy.deepcopy(model)
        lora.add_lora(adapted, targets, r=r)  # 280 = q 32 + k 24 + v 24 + o 32 + gate 56 + up 56 + down 56
        assert lora.adapter_params(shape, r, targets) == count_parameters(adapted, trainable_only=True) == hand


def test_finetune_state_bytes_keeps_the_unquantized_part_of_a_qlora_base_in_16_bits():
    got = lora.finetune_state_bytes(1000, 10, 2, unquantized_params=200, packed_bits=4)
    assert got == {"full fine-tune": 16_000, "LoRA": 2 * 1000 + 160, "QLoRA (4-bit base)": 800 / 2 + 200 * 2 + 160}
    # NF4 by default: 16,384 weights are 8,192 bytes of 4-bit codes, 256 one-byte scales and one fp32 scale of those
    assert lora.finetune_state_bytes(16_384, 0, 4)["QLoRA (4-bit base)"] == 8192 + 256 + 4
    llama = PUBLISHED_SHAPES["Llama-2-7B"]
    kept = llama.n_params - llama.linear_params
    qlora = lora.finetune_state_bytes(llama.n_params, lora.adapter_params(llama, 8), 2, unquantized_params=kept)
    # 6,476,005,376 linears: / 2 bytes of codes + / 64 scale bytes + / 16,384 × 4 bytes; 262,410,240 kept × 2 bytes;
    # 4,194,304 adapters × 16 bytes
    packed = 3_238_002_688 + 101_187_584 + 1_581_056
    assert qlora["QLoRA (4-bit base)"] == pytest.approx(packed + 524_820_480 + 67_108_864, rel=1e-12)
    all_packed = lora.finetune_state_bytes(llama.n_params, lora.adapter_params(llama, 8), 2)["QLoRA (4-bit base)"]
    assert (qlora["QLoRA (4-bit base)"] - all_packed) / 2**30 == pytest.approx(0.3627, abs=1e-4)
    assert qlora["full fine-tune"] == 16 * 6_738_415_616 and qlora["LoRA"] == 2 * 6_738_415_616 + 16 * 4_194_304


@pytest.mark.parametrize(
    "args, kwargs, error",
    [
        ((1000.0, 10, 2), {}, TypeError),  # a count given as a float
        ((1000, True, 2), {}, TypeError),
        ((1000, 10, "2"), {}, TypeError),
        ((1000, 10, 2), {"packed_bits": float("nan")}, TypeError),
        ((0, 0, 2), {}, ValueError),
        ((1000, -1, 2), {}, ValueError),
        ((1000, 1001, 2), {}, ValueError),  # more trainable than there are parameters
        ((1000, 10, 2), {"unquantized_params": 1001}, ValueError),
        ((1000, 10, 0), {}, ValueError),
        ((1000, 10, 2), {"packed_bits": 0}, ValueError),
    ],
)
def test_finetune_state_bytes_refuses_impossible_inputs(args, kwargs, error):
    with pytest.raises(error):
        lora.finetune_state_bytes(*args, **kwargs)


def test_adapter_params_refuse_impossible_shapes_and_targets():
    llama = PUBLISHED_SHAPES["Llama-2-7B"]
    with pytest.raises(TypeError, match="shape must be a models.DecoderShape, got dict"):
        lora.adapter_params(dataclasses.asdict(llama), 8)
    with pytest.raises(ValueError, match="r must"):
        lora.adapter_params(llama, 0)
    with pytest.raises(ValueError, match="qkv"):
        lora.adapter_params(llama, 8, ("qkv",))
    with pytest.raises(TypeError, match="sequence"):
        lora.adapter_params(llama, 8, "q_proj")


def test_finetune_and_score_refuses_a_model_with_nothing_to_train():
    model = tiny_llama().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        lora.finetune_and_score("frozen", model, None, [], [], train.TrainConfig(steps=1), 1, 64)


@pytest.mark.model
def test_finetune_and_score_trains_adapters_and_scores_the_task(default_model):
    base, tokenizer = default_model
    model = copy.deepcopy(base)
    lora.add_lora(model, ("q_proj", "v_proj"), r=8)
    examples = tasks.title_examples("train", limit=4)
    held_out = tasks.title_examples("validation", limit=2)
    cfg = train.TrainConfig(steps=2, lr=1e-3, progress=False)
    result = lora.finetune_and_score(
        "r8", model, tokenizer, examples, held_out, cfg, batch_size=2, max_length=128, max_new_tokens=4
    )
    assert result.trainable == 460_800 and len(result.losses) == 2 and result.step_seconds > 0
    assert result.step_times == [result.step_seconds]  # the second step's time: the first one is left out
    assert result.peak_memory.peak_bytes > 0 and result.eval_loss > 0 and 0 <= result.accuracy <= 1
    assert len(result.predictions) == 2
    assert result.row(count_parameters(base))["share"] == "0.34 %"


@pytest.mark.model
def test_default_model_q_v_rank_8_trains_a_third_of_a_percent(default_model):
    model, _ = default_model
    model = copy.deepcopy(model)
    lora.add_lora(model, ("q_proj", "v_proj"), r=8)
    trainable, total = count_parameters(model, trainable_only=True), count_parameters(model)
    assert trainable == 30 * 8 * ((576 + 576) + (576 + 192))  # 460,800, PEFT's count on SmolLM2
    assert trainable / total < 0.004


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_saved_adapters_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    with umask(mask):
        path = lora.save_adapter(lora.apply_peft(tiny_llama(), ("q_proj", "v_proj"), r=4), tmp_path / "adapter")
    found = modes(path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= found.keys()
    assert found == dict.fromkeys(found, file_mode) | {".": dir_mode}
