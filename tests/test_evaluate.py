"""Perplexity windows and values, and generation."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from labcourse.expected import EXPECTED
from labkit import evaluate
from labkit.models import tiny_llama


class ByteTokenizer:
    """Bytes as tokens (vocab 256 + EOS), the minimal tokenizer interface perplexity needs."""

    eos_token_id = 256

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


class Uniform(nn.Module):
    """Predicts every token with equal probability: its perplexity is exactly the vocabulary size."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


@given(n=st.integers(1, 300), max_length=st.integers(2, 64), data=st.data())
def test_windows_score_each_token_at_most_once(n, max_length, data):
    stride = data.draw(st.integers(1, max_length))
    scored = []
    for begin, end, k in evaluate.windows(n, max_length, stride):
        assert 0 <= begin < end <= n and end - begin <= max_length and 0 < k < end - begin + 1
        scored += range(end - k, end)
    assert len(scored) == len(set(scored)) and 0 not in scored
    if stride < max_length:  # overlapping windows: every token after the first, once
        assert scored == list(range(1, n))
    else:  # side by side: every token but each window's first, which has no context
        assert scored == [t for t in range(n) if t % max_length]


def test_windows_reject_bad_stride():
    with pytest.raises(ValueError, match="stride"):
        evaluate.windows(10, 4, 5)


def test_uniform_model_has_perplexity_equal_to_vocab():
    result = evaluate.perplexity(Uniform(257), ByteTokenizer(), ["hello world", "abc"], max_length=4, progress=False)
    assert result.perplexity == pytest.approx(257)
    assert result.nll == pytest.approx(math.log(257))
    # 16 tokens (11 + EOS + 3 + EOS) in 4 non-overlapping windows of 4: first token of each unscored
    assert (result.tokens, result.windows) == (12, 4)


def test_perplexity_matches_manual_loss_on_a_real_model():
    model = tiny_llama(vocab_size=257)
    tok = ByteTokenizer()
    texts = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs."]
    result = evaluate.perplexity(model, tok, texts, max_length=16, progress=False)
    stream = torch.tensor(evaluate.token_stream(tok, texts))
    total, count = 0.0, 0
    for chunk in stream.split(16):
        if len(chunk) < 2:
            continue
        with torch.no_grad():
            loss = model(input_ids=chunk[None], labels=chunk[None]).loss  # HF mean over len-1 targets
        total += loss.item() * (len(chunk) - 1)
        count += len(chunk) - 1
    assert result.tokens == count
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_perplexity_scores_in_eval_mode_and_restores_training_mode():
    from labkit.models import tiny_gpt2

    model = tiny_gpt2(vocab_size=257)  # GPT-2 has dropout 0.1: train mode would change the figure
    texts = ["dropout must be off while scoring"]
    expected = evaluate.perplexity(model, ByteTokenizer(), texts, max_length=16, progress=False)
    model.train()
    again = evaluate.perplexity(model, ByteTokenizer(), texts, max_length=16, progress=False)
    assert again.perplexity == expected.perplexity
    assert model.training


def test_perplexity_rejects_empty_input():
    with pytest.raises(ValueError, match="non-empty"):
        evaluate.perplexity(Uniform(257), ByteTokenizer(), ["  "], progress=False)
    with pytest.raises(ValueError, match="max_length"):
        evaluate.perplexity(Uniform(257), ByteTokenizer(), ["a"], max_length=1, progress=False)


class Refuses(nn.Module):
    """A model and tokenizer in one that fail if they are ever used: the arguments must be refused first."""

    eos_token_id = 256

    def __init__(self):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))

    def __call__(self, *args, **kwargs):
        raise AssertionError("used before the arguments were checked")


def test_split_perplexity_scores_the_first_documents_of_a_split_by_hand(tmp_path):
    corpus = tmp_path / "three.txt"
    corpus.write_text("alpha beta\n\ngamma\n\ndelta epsilon zeta\n", encoding="utf-8")
    result = evaluate.split_perplexity(
        Uniform(257), ByteTokenizer(), "all", corpus=str(corpus), documents=2, max_length=64, progress=False
    )
    # "alpha beta" + EOS + "gamma" + EOS: 17 byte tokens in one window, all but the first scored
    assert (result.tokens, result.windows) == (16, 1)
    assert result.perplexity == pytest.approx(257)
    model = tiny_llama(vocab_size=257)
    got = evaluate.split_perplexity(
        model, ByteTokenizer(), "all", documents=3, corpus=str(corpus), max_length=8, progress=False
    )
    stream = torch.tensor([*b"alpha beta", 256, *b"gamma", 256, *b"delta epsilon zeta", 256])
    total = 0.0
    for chunk in stream.split(8):  # side by side windows of 8, each scoring all but its first token
        with torch.no_grad():
            total += model(input_ids=chunk[None], labels=chunk[None]).loss.item() * (len(chunk) - 1)
    assert (got.tokens, got.windows) == (len(stream) - 5, 5)
    assert got.perplexity == pytest.approx(math.exp(total / (len(stream) - 5)), rel=1e-5)


def test_split_perplexity_is_perplexity_on_the_splits_first_texts():
    from labkit.data import load_corpus

    model, tok = tiny_llama(vocab_size=257), ByteTokenizer()
    texts = load_corpus("wiki", "validation")[:2]
    expected = evaluate.perplexity(model, tok, texts, max_length=64, progress=False)
    got = evaluate.split_perplexity(model, tok, documents=2, max_length=64, progress=False)
    assert got == expected


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"documents": 0}, ValueError, "documents must be an int >= 1"),
        ({"documents": 2.0}, TypeError, "documents must be an int"),
        ({"documents": 2, "max_length": 2.0}, TypeError, "max_length must be an int"),
        ({"documents": 2, "max_length": 1}, ValueError, "max_length must be an int >= 2"),
        ({"documents": 2, "progress": 0}, TypeError, "progress must be True or False"),
        ({"documents": 2, "split": "dev"}, ValueError, "unknown split 'dev'"),
        ({"documents": 10**6}, ValueError, "'validation' split of wiki holds \\d+ documents, fewer than 1000000"),
    ],
)
def test_split_perplexity_refuses_bad_arguments_before_any_work(kwargs, error, match):
    refuses = Refuses()
    with pytest.raises(error, match=match):
        evaluate.split_perplexity(refuses, refuses, **kwargs)


def test_split_perplexity_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got ByteTokenizer"):
        evaluate.split_perplexity(ByteTokenizer(), ByteTokenizer(), documents=2)


@pytest.mark.model
def test_default_model_perplexity_on_wiki_validation_is_in_range(default_model):
    from labkit.data import load_corpus

    model, tokenizer = default_model
    result = evaluate.perplexity(
        model, tokenizer, load_corpus("wiki", "validation")[:4], max_length=256, progress=False
    )
    # lab 00's smoke figure, the same four articles and window: 18.70 on the AMD EPYC and Intel Xeon VMs
    assert result.perplexity in EXPECTED["00"]["smoke"]["perplexity"]


@pytest.mark.model
def test_generation_is_reproducible_and_validated(default_model):
    model, tokenizer = default_model
    prompt = "Name a colour."
    rng = torch.get_rng_state()
    assert evaluate.generate(model, tokenizer, prompt, max_new_tokens=8) == evaluate.generate(
        model, tokenizer, prompt, max_new_tokens=8
    )
    sampled = [evaluate.generate(model, tokenizer, prompt, max_new_tokens=8, temperature=1.0, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert torch.equal(torch.get_rng_state(), rng)  # greedy draws nothing; sampling draws from its own seed
    with pytest.raises(ValueError, match="max_new_tokens"):
        evaluate.generate(model, tokenizer, prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        evaluate.generate(model, tokenizer, prompt, temperature=-1)
