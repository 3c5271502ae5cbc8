"""labkit.calibration: calibration windows, the block-by-block sweep, input Hessians, the inverse-Hessian factor."""

from __future__ import annotations

import pytest
import torch

from labkit.calibration import (
    _first_block_inputs,
    _input_hessian,
    _sequential_groups,
    calibrated_sweep,
    calibration_blocks,
    input_hessian,
    inverse_hessian_factor,
)
from labkit.models import tiny_llama
from labkit.torchutil import decoder_layers
from tests.numerics import FLOAT64, assert_within, reorder_bound

GROUPS = [
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    ["self_attn.o_proj"],
    ["mlp.gate_proj", "mlp.up_proj"],
    ["mlp.down_proj"],
]


def correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Inputs with strongly correlated features, as real activations have (a Hessian far from diagonal)."""
    g = torch.Generator().manual_seed(seed)
    factors = torch.randn(n, dim // 4, generator=g) @ torch.randn(dim // 4, dim, generator=g)
    return factors + 0.1 * torch.randn(n, dim, generator=g)


def test_sequential_groups_follow_the_data_flow(tiny, calibration):
    layers = decoder_layers(tiny)
    inputs, kwargs = _first_block_inputs(tiny, layers, calibration[:2], batch_size=2)
    assert _sequential_groups(layers[0], inputs[0], kwargs[0]) == GROUPS


def test_input_hessian_is_two_x_xt_over_n(tiny, calibration):
    layers = decoder_layers(tiny)
    inputs, kwargs = _first_block_inputs(tiny, layers, calibration[:4], batch_size=2)
    seen = []
    down = layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, m.in_features)))
    with torch.no_grad():
        for x, kw in zip(inputs, kwargs):
            layers[0](x, **kw)
    handle.remove()
    x = torch.cat(seen)
    h, n = _input_hessian(layers[0], down, inputs, kwargs)
    assert n == 4 * 64 and h.dtype == torch.float32
    x = x.double()  # H: a float64 sum (in another order than this one) rounded once to fp32
    expected = 2 * x.T @ x / n
    bound = torch.finfo(torch.float32).eps / 2 * expected.abs() + reorder_bound(
        n, 2 * x.abs().T @ x.abs() / n, torch.float64
    )
    assert_within(h.double(), expected, bound)


class CharTokenizer:
    """One token per character (ids = code points), EOS = 0: enough for calibration_blocks."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_calibration_blocks_are_deterministic_non_overlapping_windows():
    texts = ["abcdefgh" * 5, "ijklmnop" * 5]  # 82 tokens with the two EOS
    blocks = calibration_blocks(CharTokenizer(), texts, n_blocks=3, block_size=16, seed=1)
    assert blocks.shape == (3, 16) and blocks.dtype == torch.long
    assert torch.equal(blocks, calibration_blocks(CharTokenizer(), texts, 3, 16, seed=1))
    stream = [t for text in texts for t in [ord(c) for c in text] + [0]]
    starts = [next(i for i in range(0, len(stream), 16) if stream[i : i + 16] == row.tolist()) for row in blocks]
    assert len(set(starts)) == 3
    with pytest.raises(ValueError, match="fewer than the 9"):
        calibration_blocks(CharTokenizer(), texts, n_blocks=9, block_size=16)


def test_input_hessian_of_a_whole_model_equals_the_block_level_one(tiny, calibration):
    layers = decoder_layers(tiny)
    inputs, kwargs = _first_block_inputs(tiny, layers, calibration[:4], batch_size=2)
    expected, _ = _input_hessian(layers[0], layers[0].self_attn.q_proj, inputs, kwargs)
    h = input_hessian(tiny, "model.layers.0.self_attn.q_proj", calibration[:4], batch_size=2)
    torch.testing.assert_close(h, expected)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        input_hessian(tiny, "model.layers.0.self_attn", calibration[:4])


def test_the_sweep_visits_every_group_in_order_on_the_inputs_the_solves_before_it_left(calibration):
    model = tiny_llama()
    seen = []

    def solve(names, modules, hessian):
        seen.append((names, hessian.clone()))
        if names[0].endswith("0.mlp.gate_proj"):  # gate and up at zero: down_proj reads zeros from now on
            for m in modules:
                m.weight.data.zero_()

    first = input_hessian(model, "model.layers.0.self_attn.q_proj", calibration[:4], batch_size=2)
    calibrated_sweep(model, calibration[:4], solve, batch_size=2, progress=False)
    assert [names for names, _ in seen] == [
        [f"model.layers.{i}.{name}" for name in group] for i in range(len(decoder_layers(model))) for group in GROUPS
    ]
    torch.testing.assert_close(seen[0][1], first)  # block 0's first group: the model as it came
    assert not seen[3][1].any()  # down_proj of block 0, after the solve of gate/up zeroed them


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inverse_hessian_factor_leaves_the_hessian_alone_and_keeps_its_dtype(dtype):
    x = correlated_inputs(256, 32).to(dtype)
    h = 2 * x.T @ x / 256
    before = h.clone()
    u = inverse_hessian_factor(h, damp=0.01)
    assert torch.equal(h, before) and u.dtype == dtype
    damped = before.double() + 0.01 * before.double().diagonal().mean() * torch.eye(32, dtype=torch.float64)
    expected, uu = torch.linalg.inv(damped), u.double()  # U is the upper factor of the damped H⁻¹
    # U rounded to `dtype` moves each product U_ki·U_kj by up to ~2 roundoffs of it; plus float64's own error
    bound = 3 * torch.finfo(dtype).eps * (uu.abs().T @ uu.abs()) + FLOAT64["atol"] * expected.abs().max()
    assert_within(uu.T @ uu, expected, bound)


def test_inverse_hessian_factor_refuses_a_hessian_no_damping_makes_definite():
    x = correlated_inputs(8, 32)  # 8 tokens cannot span 32 dimensions
    with pytest.raises(ValueError, match="not positive definite"):
        inverse_hessian_factor(2 * x.T @ x / 8, damp=0.0)
