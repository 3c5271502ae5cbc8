"""Profiles: one table, env override, auto-detection, clear error on a typo, sizes that fit the data."""

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit import profiles


def test_env_var_overrides_detection(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "GPU")
    assert profiles.get_profile().name == "gpu"


def test_argument_beats_env(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "gpu")
    assert profiles.get_profile("smoke").name == "smoke"


def test_auto_detects_cpu_without_cuda(monkeypatch):
    import torch

    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profiles.get_profile().name == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert profiles.get_profile().name == "gpu"


def test_unknown_profile_lists_choices(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "fast")
    with pytest.raises(ValueError, match=r"unknown profile 'fast' \(from \$LABKIT_PROFILE\).*smoke, cpu, gpu"):
        profiles.get_profile()


def test_sizes_grow_from_smoke_to_gpu():
    smoke, cpu, gpu = (profiles.PROFILES[n] for n in ("smoke", "cpu", "gpu"))
    for part in dataclasses.fields(profiles.Profile)[2:]:
        sections = [getattr(p, part.name) for p in (smoke, cpu, gpu)]
        for f in dataclasses.fields(sections[0]):
            if f.type == "int":
                small, mid, large = (getattr(section, f.name) for section in sections)
                assert small <= mid <= large, f"{part.name}.{f.name}"
    assert max(smoke.timing.matmul_sizes) < max(cpu.timing.matmul_sizes) < max(gpu.timing.matmul_sizes)


def test_ranks_on_the_cpu_get_the_cpu_sizes_under_the_gpu_profile():
    gpu, cpu, smoke = (profiles.get_profile(n) for n in ("gpu", "cpu", "smoke"))
    assert profiles.for_device(gpu, "cpu") is cpu  # two ranks on a one-GPU node: CPU processes, CPU sizes
    assert profiles.for_device(gpu, "cuda") is gpu
    assert profiles.for_device(cpu, "cuda") is cpu  # a profile the user chose is kept where it fits
    assert profiles.for_device(smoke, "cpu") is smoke and profiles.for_device(smoke, "cuda") is smoke
    assert gpu.train.hidden > cpu.train.hidden  # so the switch changes what the ranks compute
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        profiles.for_device(gpu, "gpu")
    with pytest.raises(TypeError, match="profiles.Profile"):
        profiles.for_device("gpu", "cpu")


def test_describe_lists_every_section_then_its_sizes():
    profile = profiles.PROFILES["cpu"]
    head, *rest = profiles.describe(profile).split("\n")
    assert head == "profile 'cpu': a laptop or a 2-core VM: minutes per lab, the real model"
    listed, section = {}, None
    for line in rest:
        if line.startswith("    "):
            key, value = line.strip().split(" = ")
            listed[section][key] = value
        else:
            section = line.strip().removesuffix(":")
            listed[section] = {}
    assert listed["lora"] == {
        "steps": "30",
        "batch_size": "4",
        "max_length": "256",
        "eval_examples": "40",
        "ranks": "(4, 8, 16)",
    }
    assert list(listed) == [f.name for f in dataclasses.fields(profiles.Profile)[2:]]
    for name, sizes in listed.items():
        section = getattr(profile, name)
        assert sizes == {f.name: str(getattr(section, f.name)) for f in dataclasses.fields(section)}, name


@pytest.mark.parametrize("name", list(profiles.PROFILES))
def test_gptq_calibration_gives_the_default_model_a_well_conditioned_hessian(name):
    """Lab 07 and 08 quantize SmolLM2, whose widest decoder layer (down_proj) has 1536 inputs."""
    from labkit.calibration import TOKENS_PER_INPUT

    p = profiles.PROFILES[name]
    assert p.quant.calibration_blocks * p.quant.calibration_block_size >= TOKENS_PER_INPUT * 1536


# ----------------------------------------------------------------------------- sizes against the data
#
# Every lab draws documents, tokens, blocks and batches from the offline corpus with the profile's
# sizes. The checks below recompute, from the data itself (token counts from the tokenizers, block
# counts from the shard layout), what each lab asks for and what exists, for every profile. They
# model the lab cells quoted in LAB_LINES; a lab that changes those lines fails here until its model
# below is updated with it.

LABS = Path(__file__).resolve().parents[1] / "labs"
DEFAULT_SHARD_TOKENS = 2**20  # shards.tokenize_to_shards' default: the splits used here fit in one shard

# Labs 04, 05 and 09 give their ranks profiles.for_device(profile, ...): the gpu profile's sizes on GPU ranks, the cpu
# profile's on CPU ranks; each profile's rows below cover the sizes it gives.
LAB_LINES = {
    "00_gpu_setup": ["texts = validation[: profile.eval.documents]"],
    "01_data_and_tokenization": [
        "bpe_docs = kept[: profile.bpe.documents]",
        'shard_paths = shards.write_shards(stream, out / "shards", shard_tokens=len(stream) // 4 + 1,',
        "loader = shards.make_loader(shard_paths, profile.train.block_size, profile.train.batch_size, seed=0,",
        "runs = [shards.loader_throughput(loader, profile.loader.batches, device) for _ in range(3)]",
    ],
    "02_mixed_precision": [
        'paths = shards.tokenize_to_shards(load_corpus("wiki", "train"), tokenizer, data_dir)',
        "cfg = TrainConfig(steps=profile.train.steps,",
        "loader = shards.make_loader(paths, profile.train.block_size, profile.train.batch_size, seed=0, device=device)",
    ],
    "03_gradient_accumulation": [
        "lengths = [profile.train.block_size >> k for k in (0, 3, 1, 4, 2, 0, 3, 1)]",
        'load_corpus("wiki", "train")[:8]), lengths)]',
        "block = min(profile.train.block_size // 4, len(stream) // 8)",
        "micro_size = max(1, profile.train.batch_size // 4)",
        'paths = shards.tokenize_to_shards(load_corpus("wiki", "train")[:400], tokenizer,',
        "history = fit(model, loader, TrainConfig(steps=3, accum_steps=k, progress=False))",
        "cfg = TrainConfig(steps=profile.train.steps, lr=2e-3,",
        "grad_clip=1.0, accum_steps=4,",
    ],
    "04_data_parallelism": [
        'shards.tokenize_to_shards(load_corpus("wiki", "train")[:2000], tokenizer, data_dir,',
        "data_dir, shard_tokens=2**17)",
        "steps = max(4, rank_profile.train.steps // 2)",
        "micro = max(1, rank_profile.train.batch_size // 4)",
        "for nproc in (1, 2):",
    ],
    "06_magnitude_pruning": [
        "def ppl(m, documents=profile.eval.documents):",
        "evaluate.split_perplexity(m, tokenizer, documents=documents, max_length=profile.eval.max_length",
        "probe = lambda m: ppl(m, profile.prune.sensitivity_documents)",
        "stream = torch.tensor(evaluate.token_stream(tokenizer, train_texts[:64]))",
        "calibration = list(stream[: 8 * profile.finetune.block_size].view(8, -1).split(2))",
        'paths = shards.tokenize_to_shards(train_texts, tokenizer, OUT / "shards")',
        "shards.make_loader(paths, profile.finetune.block_size, profile.finetune.batch_size, seed=seed,",
        "per_round = replace(finetune, steps=max(1, profile.finetune.steps // len(rounds_at)))",
        'calibration = quant.calibration_blocks(tokenizer, load_corpus("wiki", "train"),',
        "profile.prune.calibration_blocks, profile.quant.calibration_block_size",
        "for n in profile.prune.calibration_sizes:",
        "wanda_half(calibration[:n])",
    ],
    "07_gptq_quantization": [
        "evaluate.split_perplexity(m, tokenizer, documents=profile.eval.documents, max_length=profile.eval.max_length",
        'calibration = quant.calibration_blocks(tokenizer, load_corpus("wiki", "train"),',
        'held_out = quant.calibration_blocks(tokenizer, load_corpus("wiki", "validation"),',
        "x = calibration[:1, :256].to(device)",
    ],
    "08_lora_finetuning": [
        'train_examples = tasks.title_examples("train")[: profile.lora.steps * profile.lora.batch_size]',
        'held_out = tasks.title_examples("validation", limit=profile.lora.eval_examples)',
        "evaluate.split_perplexity(m, tokenizer, documents=profile.eval.documents, max_length=profile.eval.max_length",
        'calibration = quant.calibration_blocks(tokenizer, load_corpus("wiki", "train"),',
    ],
    "09_memory_at_scale": [
        'shards.tokenize_to_shards(load_corpus("wiki", "train"), tokenizer, data_dir, shard_tokens=2**18)',
        "ranks = gpus if gpus >= 2 else 2",
        "batch_size, seq = rank_profile.scale.batch, rank_profile.scale.seq",
        'f"--steps={rank_profile.scale.steps}"',
    ],
}


def _squash(code: str) -> str:
    """Code without whitespace: the formatter may rewrap a call, which changes nothing it draws."""
    return re.sub(r"\s+", "", code)


@pytest.mark.parametrize("lab", list(LAB_LINES))
def test_the_labs_still_draw_what_the_checks_model(lab):
    import nbformat

    cells = nbformat.read(LABS / f"{lab}.ipynb", as_version=4).cells
    source = _squash("\n".join(c.source for c in cells if c.cell_type == "code"))
    missing = [line for line in LAB_LINES[lab] if _squash(line) not in source]
    assert not missing, f"labs/{lab}.ipynb no longer has {missing}: update the model of it in this file"


@dataclass(frozen=True)
class Draw:
    """One thing a lab draws: how much it asks for and how much the data holds."""

    lab: str
    what: str
    asked: int
    available: int


def stream_tokens(doc_tokens: list[int]) -> int:
    """Tokens of the EOS-joined stream the labs build (evaluate.token_stream, tokenize_to_shards)."""
    return sum(n + 1 for n in doc_tokens)


def loader_blocks(n_tokens: int, block_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> int:
    """Blocks a shard loader serves: shards of shard_tokens (the last shorter), (length - 1) // block each."""
    full, rest = divmod(n_tokens, shard_tokens)
    lengths = [shard_tokens] * full + [rest] * bool(rest)
    return sum((n - 1) // block_size for n in lengths)


@pytest.fixture(scope="module")
def corpus() -> dict:
    """The offline corpus counted: SmolLM2 tokens per article and per title; lab 01's cleaned articles."""
    from labkit import clean
    from labkit.data import load_documents
    from labkit.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    counts = {}
    for split in ("train", "validation"):
        docs = load_documents("wiki", split)
        for key, texts in ((split, [d.text for d in docs]), (f"{split} titles", [d.title for d in docs])):
            counts[key] = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    counts["kept"] = clean.clean_corpus([d.text for d in load_documents("wiki", "train")])[0]
    return counts


@pytest.fixture(scope="module")
def own_bpe_tokens(corpus):
    """Tokens of lab 01's stream in its largest own BPE (`tokenizers` learns labkit's merges)."""
    from labkit.bpe import train_hf_bpe

    cache = {}

    def tokens(documents: int, vocab_size: int) -> int:
        if (documents, vocab_size) not in cache:
            texts = corpus["kept"][:documents]
            bpe = train_hf_bpe(texts, vocab_size)
            cache[documents, vocab_size] = sum(len(e.ids) + 1 for e in bpe.encode_batch(texts))
        return cache[documents, vocab_size]

    return tokens


def draws(p: profiles.Profile, corpus: dict, own_bpe_tokens) -> list[Draw]:
    """What every lab asks of the data under profile p, beside what the data holds."""
    train, val = corpus["train"], corpus["validation"]
    rows = [
        Draw("00 06 07 08", "validation articles scored (eval.documents)", p.eval.documents, len(val)),
        Draw(
            "00 06 07 08",
            "a full perplexity window (eval.max_length) in their tokens",
            p.eval.max_length,
            stream_tokens(val[: p.eval.documents]),
        ),
        Draw("06", "validation articles per sensitivity probe", p.prune.sensitivity_documents, len(val)),
    ]
    # Lab 01: BPE on the cleaned train articles, their stream in 4 shards, one warm-up batch, then the timing.
    bpe_tokens = own_bpe_tokens(p.bpe.documents, p.bpe.vocab_sizes[-1])
    blocks = loader_blocks(bpe_tokens, p.train.block_size, bpe_tokens // 4 + 1)
    rows += [
        Draw("01", "cleaned train articles for the own BPE", p.bpe.documents, len(corpus["kept"])),
        Draw(
            "01",
            "batches timed (loader.batches) vs one epoch less the warm-up",
            p.loader.batches,
            math.ceil(blocks / p.train.batch_size) - 1,
        ),
    ]
    # Lab 02: train.steps batches from the whole train split, each block at most once.
    rows.append(
        Draw(
            "02",
            "blocks per run (train.steps x train.batch_size), one epoch at most",
            p.train.steps * p.train.batch_size,
            loader_blocks(stream_tokens(train), p.train.block_size),
        )
    )
    # Lab 03: 8 documents cut to train.block_size >> k tokens; packed into 8 blocks for 4 micro-batches of 2.
    cut = [min(n, p.train.block_size >> k) for n, k in zip(train[:8], (0, 3, 1, 4, 2, 0, 3, 1))]
    packed = stream_tokens(cut)
    block = min(p.train.block_size // 4, packed // 8)
    micro = max(1, p.train.batch_size // 4)
    lab03_blocks = loader_blocks(stream_tokens(train[:400]), p.train.block_size)
    rows += [
        Draw("03", "tokens in the shortest cut document (pad_batch refuses empty ones)", 1, min(cut)),
        Draw("03", "tokens per packed block (an input and a target)", 2, block),
        Draw("03", "packed blocks for 4 micro-batches of 2", 8, packed // block),
        # fit cycles through the 400 articles' blocks (the cpu run goes through them 1.85 times): each
        # micro-batch must still be full.
        Draw("03", "blocks of 400 articles for one micro-batch (fit cycles)", micro, lab03_blocks),
    ]
    # Lab 04: 2000 articles in shards of 2**17 tokens, dealt to 2 ranks; each rank's blocks at most once.
    steps = max(4, p.train.steps // 2)
    rows.append(
        Draw(
            "04",
            "blocks per rank of 2 (steps x micro-batch), one epoch at most",
            steps * micro,
            loader_blocks(stream_tokens(train[:2000]), p.train.block_size, 2**17) // 2,
        )
    )
    # Lab 06: Taylor calibration from 64 articles; recovery fine-tunes on the train split, no block twice.
    rows += [
        Draw(
            "06",
            "calibration tokens (8 x finetune.block_size) in 64 train articles",
            8 * p.finetune.block_size,
            stream_tokens(train[:64]),
        ),
        Draw(
            "06",
            "blocks per fine-tune (finetune.steps x finetune.batch_size), one epoch at most",
            p.finetune.steps * p.finetune.batch_size,
            loader_blocks(stream_tokens(train), p.finetune.block_size),
        ),
        Draw(
            "06",
            "Wanda / SparseGPT calibration windows from the train split",
            p.prune.calibration_blocks,
            stream_tokens(train) // p.quant.calibration_block_size,
        ),
        Draw(
            "06",
            "calibration sizes tried, as slices of those windows",
            max(p.prune.calibration_sizes),
            p.prune.calibration_blocks,
        ),
    ]
    # Labs 07-08: GPTQ windows from train; lab 07 compares with as many held-out windows from validation.
    rows += [
        Draw(
            "07 08",
            "calibration windows from the train split",
            p.quant.calibration_blocks,
            stream_tokens(train) // p.quant.calibration_block_size,
        ),
        Draw(
            "07",
            "held-out windows from the validation split",
            p.quant.calibration_blocks,
            stream_tokens(val) // p.quant.calibration_block_size,
        ),
        Draw("07", "tokens per window, for lab 07's 256-token forward", 256, p.quant.calibration_block_size),
    ]
    # Lab 08: each train example seen once; a prompt keeps 8 tokens or more before the longest answer + EOS.
    answers = corpus["train titles"][: p.lora.steps * p.lora.batch_size]
    answers += corpus["validation titles"][: p.lora.eval_examples]
    rows += [
        Draw(
            "08",
            "train articles (lora.steps x lora.batch_size), each once",
            p.lora.steps * p.lora.batch_size,
            len(train),
        ),
        Draw("08", "held-out validation articles (lora.eval_examples)", p.lora.eval_examples, len(val)),
        Draw(
            "08",
            "longest answer + EOS + 8 prompt tokens, within lora.max_length",
            max(answers) + 1 + 8,
            p.lora.max_length,
        ),
    ]
    # Lab 09: the compression curves; every rank (one per GPU: 8 on the largest node) reads scale.steps batches of
    # its own blocks from the whole train split, one epoch at most.
    ranks = 8 if p.name == "gpu" else 2
    rows.append(
        Draw(
            "09",
            "blocks for the compression curves (scale.steps x scale.batch x ranks), one epoch at most",
            p.scale.steps * p.scale.batch * ranks,
            loader_blocks(stream_tokens(train), p.scale.seq, 2**18),
        )
    )
    return rows


@pytest.mark.parametrize("name", list(profiles.PROFILES))
def test_every_profile_asks_only_for_what_the_data_holds(name, corpus, own_bpe_tokens):
    over = [d for d in draws(profiles.PROFILES[name], corpus, own_bpe_tokens) if d.asked > d.available]
    assert not over, f"profile {name!r} asks for more than exists:\n" + "\n".join(
        f"  lab {d.lab}: {d.what}: asks {d.asked:,}, the data holds {d.available:,}" for d in over
    )
