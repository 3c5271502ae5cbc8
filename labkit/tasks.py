"""A fine-tuning task that ships offline: name the Wikipedia article a summary comes from (lab 08).

Each example is a chat prompt (the summary and the question) and an answer (the article's title).
Training batches put the loss on the answer tokens only (labels -100 on the prompt and the padding),
so `labkit.train.fit` learns to answer, not to rewrite the summary. Scoring is exact match of the
greedy answer against the title, after lower-casing and stripping punctuation.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labkit import evaluate
from labkit.data import load_documents, pad_batch
from labkit.torchutil import eval_mode

TITLE_QUESTION = "Which Wikipedia article is this summary from? Answer with the title only."


@dataclass(frozen=True)
class Example:
    """One prompt and the answer the model should give."""

    prompt: str
    answer: str


def title_examples(split: str = "train", limit: int | None = None, max_chars: int = 1200) -> list[Example]:
    """Summary → title examples from the wiki corpus; the split is the corpus's (titles never cross splits)."""
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    if not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be an int >= 1, got {max_chars!r}")
    docs = load_documents("wiki", split)[:limit]
    return [Example(f"{TITLE_QUESTION}\n\n{d.text[:max_chars]}", d.title) for d in docs]


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model sees it when generating: through the chat template when there is one."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    return tokenizer(prompt)["input_ids"]


def encode_example(tokenizer, example: Example, max_length: int) -> tuple[list[int], int]:
    """(token ids, number of prompt tokens): prompt, answer, end-of-turn token; the prompt is cut from the left."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end the answer with")
    answer = tokenizer(example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = _prompt_ids(tokenizer, example.prompt)
    room = max_length - len(answer)
    if room < 8:
        raise ValueError(f"max_length {max_length} leaves no room for a prompt before a {len(answer)}-token answer")
    prompt = prompt[-room:]
    return prompt + answer, len(prompt)


def sft_batches(
    tokenizer, examples: Sequence[Example], batch_size: int, max_length: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Shuffled, right-padded batches with labels only on the answers (what `train.fit` consumes)."""
    if batch_size < 1 or not examples:
        raise ValueError(f"need batch_size >= 1 and at least one example, got {batch_size} and {len(examples)}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = []
    for start in range(0, len(order), batch_size):
        encoded = [encode_example(tokenizer, examples[i], max_length) for i in order[start : start + batch_size]]
        batch = pad_batch([tokens for tokens, _ in encoded], pad)  # labels are -100 on the padding
        for row, (_, n_prompt) in enumerate(encoded):
            batch["labels"][row, :n_prompt] = -100  # and on the prompt: only the answer is learned
        batches.append(batch)
    return batches


def normalize(text: str) -> str:
    """Lower case, punctuation dropped, spaces collapsed: 'The Beatles.' and 'the beatles' match."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def exact_match(model: nn.Module, tokenizer, examples: Sequence[Example], max_new_tokens: int = 16) -> dict:
    """Share of greedy answers equal to the expected one (normalized), with every prediction for reading."""
    if not examples:
        raise ValueError("exact_match needs at least one example")
    predictions = [evaluate.generate(model, tokenizer, ex.prompt, max_new_tokens=max_new_tokens) for ex in examples]
    hits = [normalize(p) == normalize(ex.answer) for p, ex in zip(predictions, examples)]
    return {"accuracy": sum(hits) / len(hits), "predictions": predictions, "hits": hits}


@torch.no_grad()
def answer_loss(
    model: nn.Module, tokenizer, examples: Sequence[Example], batch_size: int = 8, max_length: int = 256
) -> float:
    """Mean cross-entropy per answer token (prompt excluded): a cheap, smooth score beside exact match."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with eval_mode(model):
        for batch in sft_batches(tokenizer, examples, batch_size, max_length):
            batch = {k: v.to(device) for k, v in batch.items()}
            n = int((batch["labels"][:, 1:] != -100).sum())  # HF shifts labels by one inside the model
            total += model(**batch).loss.item() * n
            count += n
    return total / count
