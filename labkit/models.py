"""Models: the offline default (SmolLM2-135M-Instruct), any local or Hub model, and tiny test models."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from labkit import assets, fileio
from labkit.torchutil import check_bool, check_int, device_of, is_int, seeded

# transformers is imported inside the functions that build a model or tokenizer: its model classes take
# several seconds to import, which commands and ranks that never build one should not pay.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m"


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_model(name: str) -> str:
    """Local directory (offline models, converted on first use) or Hub id that `name` refers to."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    key = name.strip().lower()
    if key in assets.OFFLINE_MODELS:
        return str(assets.offline_model_dir(key))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} exists but holds no config.json: not a transformers model directory")
        return str(path)
    if _looks_like_hub_id(name):
        return name
    raise ValueError(
        f"unknown model {name!r}: use an offline name ({', '.join(assets.OFFLINE_MODELS)}), "
        "a local model directory, or a Hugging Face id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


@contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers draws a progress bar over the tensors it reads or writes: noise for a model loaded or saved in
    a second, and in a saved notebook a widget frozen at its first frame. Off meanwhile, then as it was."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """Return (model, tokenizer) in eval mode for an offline name, a local path or a Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(name)
    if device is not None:
        device_of(device)  # a bad device is refused before the weights are read
    try:
        with _no_progress_bar():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise OSError(
            f"could not load model {name!r} from {source!r}: {err}\n"
            "Offline names and local paths need no network; a Hub id needs internet access "
            "(or a copy already in the Hugging Face cache)."
        ) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer


# What save_pretrained writes for a model and its tokenizer (and save_gptq beside them): the names by which a directory
# saved before labkit marked what it writes is recognised as a saved model that saving again may replace.
SAVED_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "quantize_config.json",
)


def is_saved_model(path: str | Path) -> bool:
    """Whether `path` holds a saved model and nothing else (see SAVED_MODEL_FILES): the `legacy` of
    fileio.atomic_directory for model writers, so that re-running a lab replaces what an older labkit saved."""
    names = [p.name for p in Path(path).iterdir()]
    return "config.json" in names and all(any(fnmatch.fnmatchcase(n, f) for f in SAVED_MODEL_FILES) for n in names)


def save_model(model: nn.Module, tokenizer: PreTrainedTokenizerBase, dest: str | Path) -> Path:
    """save_pretrained (safetensors) model and tokenizer into `dest` atomically: load_model(dest) reloads it. `dest`
    must be new, empty or a model labkit saved (fileio.atomic_directory refuses anything else)."""
    with fileio.atomic_directory(dest, legacy=is_saved_model) as tmp, _no_progress_bar():
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(dest)


def load_tokenizer(name: str = DEFAULT_MODEL, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Only the tokenizer of an offline name, a local path or a Hub id (no weights are loaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(name), trust_remote_code=trust_remote_code)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    seen = {p.data_ptr(): p for p in model.parameters() if p.requires_grad or not trainable_only}
    return sum(p.numel() for p in seen.values())


def _check_shape(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
    """Refuse sizes a model cannot have, naming the rule, before transformers builds (or half-builds) it."""
    sizes = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads}
    for name, value in {**sizes, "num_kv_heads": num_kv_heads}.items():
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")


def tiny_llama(
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> nn.Module:
    """A randomly initialized Llama (SmolLM2's architecture, with grouped-query attention) for fast runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _check_shape(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads)

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    with seeded(seed):  # weights drawn from `seed`, the caller's RNG left as it was
        return LlamaForCausalLM(config).eval()


def lab_llama(vocab_size: int, profile, seed: int = 0) -> nn.Module:
    """The small Llama that labs 02-03 train from scratch: SmolLM2's shape, sized by the run profile."""
    return tiny_llama(
        vocab_size=vocab_size,
        hidden_size=profile.train.hidden,
        num_layers=profile.train.layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=3 * profile.train.hidden,
        max_position_embeddings=profile.train.block_size,
        seed=seed,
    )


def llama_shape(vocab_size: int, hidden_size: int, num_layers: int, seq_len: int) -> dict[str, int]:
    """`tiny_llama`'s arguments for a Llama shaped like SmolLM2 at any width and depth (lab 09's model): heads
    64 wide, an MLP 8/3 as wide (rounded to even), positions for `seq_len` + 1 tokens, and two query heads per
    key/value head (SmolLM2-135M has three: its width, 576, is no multiple of 128)."""
    if not all(is_int(v) and v >= 1 for v in (vocab_size, num_layers, seq_len)):
        raise ValueError(
            f"vocab_size, num_layers and seq_len must be ints >= 1, got {vocab_size!r}, {num_layers!r}, {seq_len!r}"
        )
    if not is_int(hidden_size) or hidden_size < 128 or hidden_size % 128:
        raise ValueError(f"hidden_size must be a multiple of 128 (two 64-wide heads per KV head), got {hidden_size!r}")
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": hidden_size // 64,
        "num_kv_heads": hidden_size // 128,
        "intermediate_size": hidden_size * 8 // 3 // 2 * 2,
        "max_position_embeddings": seq_len + 1,
    }


@dataclass(frozen=True)
class DecoderShape:
    """A Llama decoder's sizes, not built (`tiny_llama(**dataclasses.asdict(shape))` builds it): no biases."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int  # the gated MLP's hidden width
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        _check_shape(self.vocab_size, self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads)
        check_int("intermediate_size", self.intermediate_size, minimum=1)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of one decoder layer, by its name in transformers' Llama."""
        h, m = self.hidden_size, self.intermediate_size
        kv = h // self.num_heads * self.num_kv_heads  # keys and values: num_kv_heads heads as wide as the queries'
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        return dict(zip(names, [(h, h), (h, kv), (h, kv), (h, h), (h, m), (h, m), (m, h)]))

    @property
    def linear_params(self) -> int:
        """The decoder layers' linear weights: what a 4-bit base packs."""
        return self.num_layers * sum(i * o for i, o in self.linear_shapes().values())

    @property
    def n_params(self) -> int:
        """Every parameter: linears, embedding (and an untied LM head), RMSNorm weights (two per layer, one final)."""
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size
        return self.linear_params + embeddings + (2 * self.num_layers + 1) * self.hidden_size


# Published models the labs reason about without loading them, by the name the labs print; each `n_params` is the
# count its checkpoint holds (tests/test_models.py checks them against the published figures).
PUBLISHED_SHAPES = {
    # HuggingFaceTB/SmolLM2-135M's config.json (Allal et al., 2025): 134,515,008 parameters, the LM head tied
    "SmolLM2-135M": DecoderShape(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        tie_word_embeddings=True,
    ),
    # Llama-2-7B (Touvron et al., 2023, "Llama 2": 6.74 B): 6,738,415,616 parameters, the LM head untied
    "Llama-2-7B": DecoderShape(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=11008,
        tie_word_embeddings=False,
    ),
}


def tiny_gpt2(
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> nn.Module:
    """A randomly initialized GPT-2 (learned positions, LayerNorm, GELU) for fast runs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _check_shape(vocab_size, hidden_size, num_layers, num_heads, num_heads)

    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=hidden_size,
        n_layer=num_layers,
        n_head=num_heads,
        n_positions=max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
    )
    with seeded(seed):
        return GPT2LMHeadModel(config).eval()
