"""Quality measurements shared by every lab: perplexity over texts or a corpus split, and text generation."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from labkit.data import concat_with_separator, encode_texts, load_corpus
from labkit.torchutil import check_bool, check_int, check_module, check_token_ids, eval_mode, is_int, seeded, vocab_size


@dataclass
class Perplexity:
    """Token-weighted result: perplexity = exp(nll_sum / tokens)."""

    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # tokens that were scored
    windows: int

    def __str__(self) -> str:
        return f"perplexity {self.perplexity:.2f} ({self.tokens} tokens in {self.windows} windows)"


def token_stream(tokenizer, texts: list[str]) -> list[int]:
    """Texts tokenized one by one (no special tokens) and joined, each followed by the EOS token."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to separate documents")
    return concat_with_separator(encode_texts(tokenizer, texts), tokenizer.eos_token_id).tolist()


def windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window; each token after the first is scored exactly once.

    Windows start every `stride` tokens and span up to `max_length`; a window scores only its
    last `n_scored` tokens (the ones no earlier window scored), so the rest serve as context.
    With stride == max_length the windows do not overlap and each window's first token,
    having no context, is not scored.
    """
    for name, value in (("n_tokens", n_tokens), ("max_length", max_length), ("stride", stride)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n_tokens < 0 or max_length < 2:
        raise ValueError(
            f"need n_tokens >= 0 and max_length >= 2 (a context and a target), got {n_tokens}, {max_length}"
        )
    if not 0 < stride <= max_length:
        raise ValueError(f"need 0 < stride <= max_length, got stride={stride}, max_length={max_length}")
    cuts, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        scored = min(end - prev_end, end - begin - 1)
        if scored > 0:
            cuts.append((begin, end, scored))
        prev_end = end
        if end == n_tokens:
            break
    return cuts


@torch.inference_mode()
def perplexity(
    model: nn.Module,
    tokenizer,
    texts: list[str],
    *,
    max_length: int = 512,
    stride: int | None = None,
    progress: bool = True,
) -> Perplexity:
    """Perplexity of `model` on `texts`, cut into windows as described in `windows()`.

    The texts are joined into one EOS-separated token stream; stride defaults to max_length
    (non-overlapping windows). Smaller strides give each token more context and a lower figure.
    """
    if not texts or not any(t.strip() for t in texts):
        raise ValueError("perplexity needs at least one non-empty text")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    stride = stride or max_length
    device = next(model.parameters()).device
    stream = torch.tensor(token_stream(tokenizer, texts), dtype=torch.long)
    check_token_ids(stream, vocab_size(model), "the tokenizer's ids")  # a tokenizer of another model
    cuts = windows(len(stream), max_length, stride)
    nll_sum, scored_total = 0.0, 0
    with eval_mode(model):  # dropout off: a model handed over mid-training is scored as it would serve
        for begin, end, scored in tqdm(cuts, desc="perplexity", disable=not progress, leave=False):
            ids = stream[begin:end].unsqueeze(0).to(device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            targets = ids[0, 1:]
            nll_sum += F.cross_entropy(logits[-scored:], targets[-scored:], reduction="sum").item()
            scored_total += scored
    mean = nll_sum / scored_total
    return Perplexity(perplexity=math.exp(mean), nll=mean, tokens=scored_total, windows=len(cuts))


def split_perplexity(
    model: nn.Module,
    tokenizer,
    split: str = "validation",
    *,
    documents: int,
    corpus: str = "wiki",
    max_length: int = 512,
    progress: bool = True,
) -> Perplexity:
    """`perplexity` of `model` on the first `documents` texts of a corpus split, in non-overlapping windows.

    How the labs and benchmarks score a model: `documents=profile.eval.documents` validation articles at
    `max_length=profile.eval.max_length`. More documents than the split holds are refused, not cut short.
    """
    check_module(model)
    check_int("documents", documents, minimum=1)
    check_int("max_length", max_length, minimum=2)
    check_bool("progress", progress)
    texts = load_corpus(corpus, split)
    if documents > len(texts):
        raise ValueError(f"the {split!r} split of {corpus} holds {len(texts)} documents, fewer than {documents}")
    return perplexity(model, tokenizer, texts[:documents], max_length=max_length, progress=progress)


@torch.inference_mode()
def generate(
    model: nn.Module,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool | None = None,
    seed: int = 0,
) -> str:
    """Continue `prompt` (through the chat template when the tokenizer has one); greedy at temperature 0."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    device = next(model.parameters()).device
    use_chat = bool(tokenizer.chat_template) if chat is None else chat
    if use_chat:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    enc = {k: v.to(device) for k, v in enc.items()}
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p}
        if temperature > 0
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    )
    sampler_rng = seeded(seed, device) if temperature > 0 else contextlib.nullcontext()
    with sampler_rng:  # sampling draws from `seed`; greedy draws nothing; the caller's RNG is left alone
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **sampling,
        )
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
