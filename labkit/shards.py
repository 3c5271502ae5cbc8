"""Token data on disk and back: checked memory-mapped shards and a rank-aware loader (packing is in data.py).

A shard is `NAME.bin` (the raw token ids, uint16 when the vocabulary fits, else uint32) plus
`NAME.json` (dtype, vocabulary size, token count, tokenizer fingerprint, SHA-256). The sidecar is
written last, so a shard without a matching sidecar was never finished; opening checks size,
tokenizer and (by default) checksum before a single token is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit import bench
from labkit.assets import cache_dir
from labkit.bpe import BPETokenizer
from labkit.data import concat_with_separator, encode_texts
from labkit.fileio import atomic_write_bytes, atomic_write_text, sha256_file

FORMAT = "labkit-shard-v1"

# ----------------------------------------------------------------------------- tokenizing into shards


def tokenizer_fingerprint(tokenizer) -> str:
    """A short digest identifying a tokenizer (labkit BPE or a transformers fast tokenizer) for shard sidecars."""
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer.fingerprint
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError("need a labkit BPETokenizer or a transformers *fast* tokenizer")
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]


def tokenize_to_shards(texts: Sequence[str], tokenizer, directory: str | Path, shard_tokens: int = 2**20) -> list[Path]:
    """Tokenize documents into an EOS-separated stream and write it as shards tagged with the tokenizer."""
    eos = tokenizer.special_ids["<|endoftext|>"] if hasattr(tokenizer, "special_ids") else tokenizer.eos_token_id
    vocab = tokenizer.vocab_size if hasattr(tokenizer, "special_ids") else len(tokenizer)
    stream = concat_with_separator(encode_texts(tokenizer, texts), eos)
    return write_shards(stream, directory, shard_tokens, vocab_size=vocab, tokenizer=tokenizer_fingerprint(tokenizer))


# ----------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardInfo:
    """The sidecar of a shard."""

    format: str
    dtype: str
    vocab_size: int
    tokens: int
    tokenizer: str
    sha256: str


def _paths(path: str | Path) -> tuple[Path, Path]:
    base = Path(path)
    base = base.with_suffix("") if base.suffix in (".bin", ".json") else base
    return base.with_name(base.name + ".bin"), base.with_name(base.name + ".json")


def write_shard(path: str | Path, tokens: np.ndarray, vocab_size: int, tokenizer: str) -> Path:
    """Write tokens as NAME.bin + NAME.json, each atomically, the sidecar last. Returns the .bin path."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError("a shard holds a non-empty 1-D array of token ids")
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in (0, 2**32], got {vocab_size}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}); found {tokens.min()}..{tokens.max()}")
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    bin_path, json_path = _paths(path)
    json_path.unlink(missing_ok=True)  # an old sidecar must never vouch for new data
    atomic_write_bytes(bin_path, tokens.astype(dtype).tobytes())
    info = ShardInfo(FORMAT, np.dtype(dtype).name, vocab_size, len(tokens), tokenizer, sha256_file(bin_path))
    atomic_write_text(json_path, json.dumps(asdict(info), indent=1))
    return bin_path


def read_shard_info(path: str | Path) -> ShardInfo:
    """The sidecar, or a clear error if it is missing or not a labkit shard."""
    bin_path, json_path = _paths(path)
    if not json_path.is_file():
        raise ValueError(f"{bin_path}: no sidecar {json_path.name}; the shard was never finished, rewrite it")
    try:
        info = ShardInfo(**json.loads(json_path.read_text()))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{json_path}: unreadable shard sidecar ({err})") from None
    if info.format != FORMAT:
        raise ValueError(f"{json_path}: format {info.format!r}, expected {FORMAT!r}")
    return info


def open_shard(path: str | Path, tokenizer: str | None = None, verify: bool = True) -> np.memmap:
    """Memory-map a shard after checking it: finished, not truncated, same tokenizer, same checksum."""
    bin_path, _ = _paths(path)
    info = read_shard_info(path)
    if not bin_path.is_file():
        raise ValueError(f"{bin_path} is missing (its sidecar exists)")
    expected = info.tokens * np.dtype(info.dtype).itemsize
    if bin_path.stat().st_size != expected:
        raise ValueError(
            f"{bin_path} has {bin_path.stat().st_size} bytes, the sidecar says {expected}: truncated or overwritten"
        )
    if tokenizer is not None and info.tokenizer != tokenizer:
        raise ValueError(f"{bin_path} was made with tokenizer {info.tokenizer}, not {tokenizer}: re-tokenize it")
    if verify and sha256_file(bin_path) != info.sha256:
        raise ValueError(f"{bin_path} does not match its SHA-256: corrupted")
    return np.memmap(bin_path, dtype=info.dtype, mode="r", shape=(info.tokens,))


def write_shards(
    stream: np.ndarray, directory: str | Path, shard_tokens: int, vocab_size: int, tokenizer: str, prefix: str = "shard"
) -> list[Path]:
    """Split a token stream into shards of shard_tokens (the last may be shorter)."""
    if shard_tokens < 2:
        raise ValueError(f"shard_tokens must be at least 2, got {shard_tokens}")
    directory = Path(directory)
    return [
        write_shard(directory / f"{prefix}_{i:05d}", stream[start : start + shard_tokens], vocab_size, tokenizer)
        for i, start in enumerate(range(0, len(stream), shard_tokens))
    ]


def is_shard_directory(path: str | Path) -> bool:
    """Whether `path` holds labkit shards and nothing else: a corpus `labkit shards` wrote before labkit marked the
    directories it writes, which writing the corpus again may replace (the `legacy` of fileio.atomic_directory)."""
    entries = list(Path(path).iterdir())
    if not all(p.is_file() and p.suffix in (".bin", ".json") for p in entries):
        return False
    try:
        sidecars = [read_shard_info(p) for p in entries if p.suffix == ".json"]
    except ValueError:
        return False
    return bool(sidecars)


def default_dir() -> Path:
    """Where `labkit shards` writes the training corpus and ddp_train.py reads it: in the (shared) cache."""
    return cache_dir() / "shards" / "wiki-smollm2"


# ----------------------------------------------------------------------------- the loader


class BlockDataset(Dataset):
    """(input, target) blocks of block_size tokens from shards; target is input shifted by one.

    Block i of a shard covers tokens [i·B, i·B + B + 1); blocks never cross shards. Shards are
    memory-mapped lazily in each worker process, so workers share the page cache, not copies.
    """

    def __init__(self, paths: Sequence[str | Path], block_size: int, tokenizer: str | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not paths:
            raise ValueError("no shards given")
        self.paths, self.block_size = [str(p) for p in paths], block_size
        counts = []
        for p in self.paths:  # every shard is checked once, up front
            counts.append(max(0, (len(open_shard(p, tokenizer)) - 1) // block_size))
        self.offsets = np.cumsum([0, *counts])
        if self.offsets[-1] == 0:
            raise ValueError(f"the shards hold no block of {block_size} + 1 tokens")
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        if shard not in self._maps:
            self._maps[shard] = open_shard(self.paths[shard], verify=False)
        start = (index - self.offsets[shard]) * self.block_size
        window = torch.from_numpy(self._maps[shard][start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


class RankSampler(Sampler[int]):
    """Seeded shuffle of block indices, dealt round-robin to data-parallel ranks.

    Every rank draws the same permutation (seed + epoch) and takes every world_size-th entry from
    position rank: ranks are disjoint and together cover every block exactly once per epoch.
    """

    def __init__(self, n: int, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.n, self.rank, self.world_size, self.seed, self.shuffle, self.epoch = n, rank, world_size, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        """A new permutation per epoch (call it before iterating, as with DistributedSampler)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.n))
        return iter(order[self.rank :: self.world_size])

    def __len__(self) -> int:
        return math.ceil((self.n - self.rank) / self.world_size)


class SlowDataset(Dataset):
    """A dataset whose every item takes `delay` seconds more: a slow storage or decoding step, made on purpose."""

    def __init__(self, dataset: Dataset, delay: float):
        self.dataset, self.delay = dataset, delay

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.delay)
        return self.dataset[index]


def make_loader(
    paths: Sequence[str | Path],
    block_size: int,
    batch_size: int,
    *,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    device: str | torch.device | None = None,
    tokenizer: str | None = None,
    shuffle: bool = True,
    prefetch_factor: int = 2,
    sample_delay: float = 0.0,
) -> DataLoader:
    """Batches of (input, target) blocks for one rank: seeded, multi-worker, pinned memory on a GPU.

    sample_delay: seconds each block waits before it is returned, a stand-in for decoding or tokenizing on the fly
    (lab 10 starves a run with it, then feeds it with workers)."""
    if batch_size < 1 or num_workers < 0 or not 0 <= sample_delay <= 60:
        raise ValueError(
            f"need batch_size >= 1, num_workers >= 0 and 0 <= sample_delay <= 60 s, "
            f"got {batch_size}, {num_workers}, {sample_delay}"
        )
    dataset = BlockDataset(paths, block_size, tokenizer)
    if sample_delay:
        dataset = SlowDataset(dataset, sample_delay)
    workers = {"num_workers": num_workers}
    if num_workers > 0:
        workers.update(prefetch_factor=prefetch_factor, persistent_workers=True)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=RankSampler(len(dataset), rank, world_size, seed, shuffle),
        pin_memory=bench.as_device(device).type == "cuda",
        **workers,
    )


def loader_throughput(loader: DataLoader, batches: int, device: str | torch.device | None = None) -> dict[str, float]:
    """Tokens per second delivered to the device over `batches` batches of one epoch, after a warm-up."""
    if not 0 < batches < len(loader):  # refuse rather than time fewer batches than asked
        raise ValueError(
            f"cannot time {batches} batches: one epoch of this loader holds {len(loader)} and "
            f"the first is the warm-up, so at most {len(loader) - 1} can be timed; ask for "
            "fewer, or give the loader more data or smaller batches"
        )
    dev = bench.as_device(device)
    it = iter(loader)
    next(it)  # start the workers
    tokens = 0
    with bench.stopwatch(dev) as elapsed:
        for _ in range(batches):
            x, y = next(it)
            x = x.to(dev, non_blocking=True)
            y = y.to(dev, non_blocking=True)
            tokens += x.numel()
    return {"tokens": tokens, "seconds": elapsed.seconds, "tokens_per_s": tokens / elapsed.seconds}


class PacedLoader:
    """A loader whose batches each take at least `delay` seconds more: a slow input pipeline on purpose, or time
    for a test or a lab to kill a run mid-way however fast a step is. The batches are the loader's, unchanged."""

    def __init__(self, loader: Any, delay: float) -> None:
        if not (isinstance(delay, (int, float)) and delay >= 0):
            raise ValueError(f"delay must be a number of seconds >= 0, got {delay!r}")
        self.loader, self.sampler, self.delay = loader, getattr(loader, "sampler", None), delay

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            time.sleep(self.delay)
            yield batch
