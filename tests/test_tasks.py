"""labkit.tasks: the summary → title task, its answer-only labels, and exact-match scoring."""

from __future__ import annotations

import pytest
import torch

from labkit import tasks


class Tok:
    """A character tokenizer without a chat template: enough for batching and loss tests without the model."""

    eos_token_id = pad_token_id = 0
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 50 + 1 for c in text]}


@pytest.fixture(scope="module")
def tokenizer():
    from labkit.models import load_tokenizer

    tok = load_tokenizer()
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def test_title_examples_do_not_cross_splits():
    train = tasks.title_examples("train")
    held = tasks.title_examples("validation") + tasks.title_examples("test")
    assert len(train) > 5000 and len(held) > 500
    assert not {e.answer for e in train} & {e.answer for e in held}
    assert train[0].prompt.startswith(tasks.TITLE_QUESTION)
    assert len(tasks.title_examples("validation", limit=3)) == 3


@pytest.mark.model
def test_labels_cover_exactly_the_answer_and_its_end_token(tokenizer):
    examples = tasks.title_examples("validation", limit=3)
    batch = tasks.sft_batches(tokenizer, examples, batch_size=3, max_length=256, seed=0)[0]
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    answers = sorted(e.answer for e in examples)
    decoded = sorted(tokenizer.decode(row[row != -100]) for row in batch["labels"])
    assert decoded == sorted(a + tokenizer.eos_token for a in answers)
    assert ((batch["labels"] != -100) <= (batch["attention_mask"] == 1)).all()  # never a label on padding
    prompt, n_prompt = tasks.encode_example(tokenizer, examples[0], 256)
    generation_prompt = tasks._prompt_ids(tokenizer, examples[0].prompt)
    assert prompt[:n_prompt] == generation_prompt  # trained on exactly what generate() will show the model


@pytest.mark.model
def test_long_prompts_are_cut_from_the_left_and_tiny_budgets_rejected(tokenizer):
    ex = tasks.Example("word " * 500, "Answer")
    ids, n_prompt = tasks.encode_example(tokenizer, ex, max_length=64)
    assert len(ids) == 64 and tokenizer.decode(ids[n_prompt:]) == "Answer" + tokenizer.eos_token
    with pytest.raises(ValueError, match="no room"):
        tasks.encode_example(tokenizer, ex, max_length=4)


def test_batches_are_shuffled_reproducibly_and_validated():
    examples = [tasks.Example(f"prompt number {i}", f"answer {i}") for i in range(10)]
    a = tasks.sft_batches(Tok(), examples, batch_size=4, max_length=64, seed=1)
    b = tasks.sft_batches(Tok(), examples, batch_size=4, max_length=64, seed=1)
    assert [len(x["input_ids"]) for x in a] == [4, 4, 2]
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    with pytest.raises(ValueError):
        tasks.sft_batches(Tok(), [], batch_size=4, max_length=64)


def test_answer_loss_counts_answer_tokens_only_whatever_the_batching():
    from labkit.models import tiny_llama

    model = tiny_llama()
    examples = [tasks.Example("short prompt", "yes"), tasks.Example("a much longer prompt " * 3, "no answer here")]
    batched = tasks.answer_loss(model, Tok(), examples, batch_size=2, max_length=128)
    losses, counts = [], []
    for ex in examples:  # one at a time: no padding at all
        losses.append(tasks.answer_loss(model, Tok(), [ex], batch_size=1, max_length=128))
        counts.append(len(ex.answer) + 1)  # the answer's tokens and the end token
    assert batched == pytest.approx(sum(loss * n for loss, n in zip(losses, counts)) / sum(counts), rel=1e-5)
    changed = [tasks.Example("another prompt entirely", ex.answer) for ex in examples]
    assert tasks.answer_loss(model, Tok(), changed, batch_size=2) != pytest.approx(batched)  # the prompt conditions it


@pytest.mark.parametrize(
    "pred, answer, same",
    [
        ("The Beatles.", "the beatles", True),
        ("Paris", "Paris, France", False),
        ("  Angkor   Wat ", "Angkor Wat", True),
        ("Album", "Albums", False),
    ],
)
def test_normalize_for_exact_match(pred, answer, same):
    assert (tasks.normalize(pred) == tasks.normalize(answer)) is same


@pytest.mark.model
def test_exact_match_scores_greedy_answers(default_model):
    model, tokenizer = default_model
    question = "What is the capital of France?"  # greedy answer (lab 00): "The capital of France is Paris."
    examples = [tasks.Example(question, "the capital of France is Paris"), tasks.Example(question, "Paris")]
    result = tasks.exact_match(model, tokenizer, examples, max_new_tokens=12)
    assert result["hits"] == [True, False] and result["accuracy"] == 0.5
