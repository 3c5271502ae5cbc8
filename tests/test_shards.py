"""Checked shards, and a loader that is seeded, rank-disjoint and complete."""

import numpy as np
import pytest
import torch

from labkit import fileio, shards
from tests.permissions import UMASK_CASES, modes, snapshot, umask


@pytest.mark.parametrize("vocab, dtype", [(300, "uint16"), (65536, "uint16"), (70000, "uint32")])
def test_shard_round_trip_picks_the_smallest_dtype(tmp_path, vocab, dtype):
    tokens = np.arange(1000) % vocab
    path = shards.write_shard(tmp_path / "s", tokens, vocab, "tok123")
    data = shards.open_shard(path, tokenizer="tok123")
    assert data.dtype == dtype and np.array_equal(data, tokens)
    info = shards.read_shard_info(path)
    assert (info.tokens, info.vocab_size, info.tokenizer) == (1000, vocab, "tok123")


@pytest.fixture
def shard(tmp_path):
    return shards.write_shard(tmp_path / "s", np.arange(500) % 300, 300, "tokA")


def test_truncated_shard_is_detected(shard):
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        shards.open_shard(shard)


def test_corrupted_shard_is_detected(shard):
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        shards.open_shard(shard)


def test_shard_from_another_tokenizer_is_refused(shard):
    with pytest.raises(ValueError, match="made with tokenizer tokA, not tokB"):
        shards.open_shard(shard, tokenizer="tokB")


def test_interrupted_write_leaves_an_unusable_shard_not_a_wrong_one(shard, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards, "atomic_write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        shards.write_shard(shard, np.arange(800) % 300, 300, "tokA")  # new data, sidecar never written
    with pytest.raises(ValueError, match="never finished"):
        shards.open_shard(shard)


def test_bad_tokens_write_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 300\)"):
        shards.write_shard(tmp_path / "s", np.array([1, 2, 300]), 300, "t")
    with pytest.raises(ValueError, match="non-empty"):
        shards.write_shard(tmp_path / "s", np.array([], dtype=np.int64), 300, "t")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def shard_set(tmp_path):
    stream = np.arange(1000) % 300
    return shards.write_shards(stream, tmp_path, shard_tokens=400, vocab_size=300, tokenizer="tokA")


def test_blocks_shift_by_one_and_stay_inside_shards(shard_set):
    ds = shards.BlockDataset(shard_set, block_size=16)
    assert len(shard_set) == 3 and len(ds) == 24 + 24 + 12  # (400-1)//16, (400-1)//16, (200-1)//16
    for i in range(len(ds)):
        x, y = ds[i]
        assert torch.equal(x[1:], y[:-1]) and x.dtype == torch.int64
    assert ds[24][0][0].item() == 400 % 300  # block 0 of the second shard starts at its token 0
    with pytest.raises(ValueError, match="no block"):
        shards.BlockDataset(shard_set[2:], block_size=500)


@pytest.mark.parametrize("n, world", [(10, 1), (10, 3), (7, 4), (3, 4)])
def test_rank_sampler_is_disjoint_and_complete(n, world):
    parts = [list(shards.RankSampler(n, r, world, seed=5)) for r in range(world)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))
    assert [len(p) for p in parts] == [len(shards.RankSampler(n, r, world)) for r in range(world)]


def test_rank_sampler_is_seeded_per_epoch():
    s = shards.RankSampler(50, seed=1)
    first = list(s)
    assert first == list(shards.RankSampler(50, seed=1))
    s.set_epoch(1)
    assert list(s) != first and sorted(s) == sorted(first)
    with pytest.raises(ValueError, match="rank < world_size"):
        shards.RankSampler(10, rank=2, world_size=2)


def test_loader_is_deterministic_with_workers_and_disjoint_across_ranks(shard_set):
    def blocks(loader):
        return [tuple(x.tolist()) for xb, _ in loader for x in xb]

    single = blocks(shards.make_loader(shard_set, 16, 4, seed=3))
    assert blocks(shards.make_loader(shard_set, 16, 4, seed=3, num_workers=2)) == single
    ranks = [blocks(shards.make_loader(shard_set, 16, 4, seed=3, rank=r, world_size=2)) for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == sorted(single)


def test_loader_checks_tokenizer_and_measures_throughput(shard_set):
    with pytest.raises(ValueError, match="re-tokenize"):
        shards.make_loader(shard_set, 16, 4, tokenizer="other")
    result = shards.loader_throughput(shards.make_loader(shard_set, 16, 4), batches=5, device="cpu")
    assert result["tokens"] == 5 * 4 * 16 and result["tokens_per_s"] > 0


def test_loader_throughput_refuses_more_batches_than_an_epoch_holds(shard_set):
    loader = shards.make_loader(shard_set, 16, 4)  # 24 + 24 + 12 blocks of 16: 15 batches of 4
    all_but_warmup = shards.loader_throughput(loader, batches=14, device="cpu")
    assert all_but_warmup["tokens"] == 14 * 4 * 16
    for batches in (15, 200, 0):
        message = f"cannot time {batches} batches: one epoch of this loader holds 15 .* at most 14"
        with pytest.raises(ValueError, match=message):
            shards.loader_throughput(loader, batches=batches, device="cpu")


def test_tokenize_to_shards_with_either_tokenizer(tmp_path, default_model):
    from labkit.bpe import train_bpe

    texts = ["first document here", "second one"]
    _, hf = default_model
    bpe = train_bpe(texts * 3, 270, progress=False)
    for name, tok in (("hf", hf), ("bpe", bpe)):
        paths = shards.tokenize_to_shards(texts, tok, tmp_path / name)
        data = shards.open_shard(paths[0], tokenizer=shards.tokenizer_fingerprint(tok))
        assert data[-1] == (bpe.special_ids["<|endoftext|>"] if name == "bpe" else hf.eos_token_id)
    assert shards.tokenizer_fingerprint(hf) != shards.tokenizer_fingerprint(bpe)
    with pytest.raises(TypeError, match="fast"):
        shards.tokenizer_fingerprint(object())


@pytest.mark.parametrize("mask, file_mode, dir_mode", UMASK_CASES)
def test_shards_get_the_modes_the_umask_gives(tmp_path, mask, file_mode, dir_mode):
    with umask(mask):
        shards.write_shard(tmp_path / "data" / "s0", np.arange(10), vocab_size=300, tokenizer="t")
    assert modes(tmp_path / "data") == {".": dir_mode, "s0.bin": file_mode, "s0.json": file_mode}


def test_paced_loader_yields_the_same_batches_each_at_least_delay_apart():
    import time

    batches = [torch.arange(3), torch.arange(3, 6)]
    started = time.perf_counter()
    assert [b.tolist() for b in shards.PacedLoader(batches, 0.05)] == [[0, 1, 2], [3, 4, 5]]
    assert time.perf_counter() - started >= 0.1
    with pytest.raises(ValueError, match="delay must be"):
        shards.PacedLoader(batches, -1)


def test_a_sample_delay_slows_each_block_and_changes_nothing_else(shard_set):
    import time

    plain = next(iter(shards.make_loader(shard_set, 16, 4, seed=3)))
    start = time.perf_counter()
    slow = next(iter(shards.make_loader(shard_set, 16, 4, seed=3, sample_delay=0.05)))
    assert time.perf_counter() - start >= 4 * 0.05  # four blocks, one after the other
    assert all(torch.equal(a, b) for a, b in zip(plain, slow))
    with pytest.raises(ValueError, match="sample_delay"):
        shards.make_loader(shard_set, 16, 4, sample_delay=-1)


def test_labkit_shards_refuses_a_folder_of_other_files(tmp_path, monkeypatch, capsys):
    from labkit import cli, data, models

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("my notes")
    monkeypatch.setattr(data, "load_corpus", lambda *args: ["a document"])  # the refusal comes before any of it
    monkeypatch.setattr(models, "load_tokenizer", lambda *args: None)
    before = snapshot(tmp_path)
    assert cli.main(["shards", str(notes), "--documents", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"labkit shards: {notes} holds files labkit did not write (todo.txt)")
    assert snapshot(tmp_path) == before and (notes / "todo.txt").read_text() == "my notes"


def _old_corpus(d):
    shards.write_shards(np.arange(10) % 300, d, 4, vocab_size=300, tokenizer="t")


# what a directory holds -> whether it is a corpus `labkit shards` wrote (before directories were marked)
SHARD_DIRECTORIES = [
    pytest.param(_old_corpus, True, id="shards"),
    pytest.param(lambda d: (_old_corpus(d), (d / "notes.txt").write_text("x")), False, id="shards-and-notes"),
    pytest.param(lambda d: (_old_corpus(d), (d / "x.json").write_text("{}")), False, id="shards-and-other-json"),
    pytest.param(lambda d: (d / "data.bin").write_bytes(b"x"), False, id="a-bin-file-alone"),
    pytest.param(lambda d: (_old_corpus(d), (d / "sub").mkdir()), False, id="shards-and-a-folder"),
]


@pytest.mark.parametrize("setup, corpus", SHARD_DIRECTORIES)
def test_a_corpus_written_before_directories_were_marked_may_be_replaced(tmp_path, setup, corpus):
    dest = tmp_path / "corpus"
    dest.mkdir()
    setup(dest)
    assert shards.is_shard_directory(dest) == corpus
    assert (fileio.destination_problem(dest, legacy=shards.is_shard_directory) is None) == corpus
