"""Run profiles: one table of sizes, so every lab runs the same code on CI, a laptop or a GPU.

A profile holds one section per lab or technique (`profile.timing.repeats`, `profile.lora.ranks`, ...).
Every size draws on the offline corpus, which is small: 9,058 train articles (955 k SmolLM2 tokens, 9,053
left after lab 01's cleaning) and 491 validation articles (53 k tokens). No profile asks for more than
that holds; tests/test_profiles.py recomputes what each lab draws against the data, for every profile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ENV_VAR = "LABKIT_PROFILE"


@dataclass(frozen=True)
class Timing:
    """How benchmarks time and what lab 00 sweeps."""

    matmul_sizes: tuple[int, ...]  # square matmul sizes for the throughput sweep (lab 00)
    copy_megabytes: tuple[int, ...]  # host<->device copy sizes (lab 00, GPU only)
    warmup: int  # untimed calls before timing
    repeats: int  # timed calls; the median is reported


@dataclass(frozen=True)
class Evaluation:
    """Perplexity and generation of the default model (labs 00, 06-08)."""

    documents: int  # validation documents scored for perplexity
    max_length: int  # perplexity window length in tokens
    max_new_tokens: int  # generation length in demos


@dataclass(frozen=True)
class Bpe:
    """Lab 01's own BPE tokenizers."""

    vocab_sizes: tuple[int, ...]  # own BPE tokenizers trained in lab 01
    documents: int  # cleaned wiki train documents they are trained on


@dataclass(frozen=True)
class Loader:
    """Lab 01's DataLoader throughput."""

    workers: tuple[int, ...]  # DataLoader worker counts compared in lab 01
    batches: int  # batches timed per loader measurement


@dataclass(frozen=True)
class Training:
    """The small Llama trained from scratch (labs 01-05, 10) and its batches."""

    block_size: int  # tokens per training block
    batch_size: int  # blocks per batch
    hidden: int  # width of the small Llama trained from scratch in labs 02-03
    layers: int  # its depth
    steps: int  # optimizer steps per training run in labs 02-03


@dataclass(frozen=True)
class Pruning:
    """Lab 06: magnitude, structured and calibrated pruning."""

    sparsities: tuple[float, ...]  # unstructured sparsities swept in lab 06
    ratios: tuple[float, ...]  # shares of MLP channels removed by structured pruning (lab 06)
    calibrated_sparsities: tuple[float | tuple[int, int], ...]  # pruned by Wanda and SparseGPT in lab 06; (n, m): N:M
    calibration_blocks: int  # their calibration windows, of quant.calibration_block_size tokens
    calibration_sizes: tuple[int, ...]  # windows tried for Wanda's calibration-size sensitivity (lab 06)
    sensitivity_documents: int  # validation documents scored per sensitivity probe (lab 06)


@dataclass(frozen=True)
class FineTuning:
    """Full fine-tuning of the default model, as lab 06's recovery after pruning."""

    block_size: int  # tokens per block when fine-tuning the default model (labs 06-08)
    batch_size: int  # blocks per fine-tuning batch
    steps: int  # optimizer steps of a fine-tuning run


@dataclass(frozen=True)
class Quantization:
    """Lab 07: GPTQ and AWQ calibration and the settings compared (lab 08's QLoRA calibrates alike)."""

    calibration_blocks: int  # GPTQ calibration windows (lab 07); the paper used 128
    calibration_block_size: int  # tokens per calibration window; the paper used 2048
    settings: tuple[tuple[int, int], ...]  # (bits, group size) compared whole-model in lab 07; -1 = per channel
    awq_calibration_blocks: int  # windows for lab 07's activation-aware scales (statistics, not a full-rank Hessian)
    awq_grid: int  # exponents α tried per layer group by lab 07's activation-aware scales (AWQ used 20)
    gptq_act_order: bool  # lab 07's landscape runs GPTQ again with act-order (False: it reuses the table's GPTQ run)


@dataclass(frozen=True)
class LoRA:
    """Lab 08: LoRA fine-tuning on the title task."""

    steps: int  # optimizer steps per fine-tuning run in lab 08 (each example seen once)
    batch_size: int  # task examples per step
    max_length: int  # tokens per example (prompt cut from the left)
    eval_examples: int  # held-out validation articles scored per run
    ranks: tuple[int, ...]  # LoRA ranks compared on q/v


@dataclass(frozen=True)
class Scale:
    """Lab 09: the SmolLM2-shaped model trained sharded on every rank."""

    hidden: int  # width of lab 09's SmolLM2-shaped model (head_dim 64, SmolLM2's vocabulary)
    layers: int  # its depth
    batch: int  # sequences per rank per step in lab 09
    seq: int  # tokens per sequence in lab 09
    steps: int  # steps per gradient-compression loss curve (lab 09); every rank reads its own blocks


@dataclass(frozen=True)
class Profiling:
    """Lab 10: the profiler's trace and the compiled step."""

    steps: int  # steps recorded by the profiler in lab 10 (after one wait and one warm-up step)
    compile: bool  # lab 10 compiles the step with torch.compile (about 30 s of compiling on a 2-core CPU)


@dataclass(frozen=True)
class Profile:
    """Sizes a lab takes from the profile, one section per concern; the code path never depends on the name."""

    name: str
    description: str
    timing: Timing
    eval: Evaluation
    bpe: Bpe
    loader: Loader
    train: Training
    prune: Pruning
    finetune: FineTuning
    quant: Quantization
    lora: LoRA
    scale: Scale
    profiling: Profiling


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="smoke",
            description="CI: seconds per lab, tiny sizes, same code path",
            timing=Timing(matmul_sizes=(64, 128, 256), copy_megabytes=(1, 8), warmup=1, repeats=3),
            eval=Evaluation(documents=4, max_length=256, max_new_tokens=16),
            bpe=Bpe(vocab_sizes=(300, 512), documents=300),
            loader=Loader(workers=(0, 1), batches=10),
            train=Training(block_size=64, batch_size=4, hidden=64, layers=2, steps=8),
            prune=Pruning(
                sparsities=(0.0, 0.5, 0.9),
                ratios=(0.2,),
                calibrated_sparsities=(0.5,),
                calibration_blocks=2,
                calibration_sizes=(1, 2),
                sensitivity_documents=1,
            ),
            finetune=FineTuning(block_size=64, batch_size=2, steps=2),
            quant=Quantization(
                # 6144 tokens: 4x the 1536 inputs of SmolLM2's down_proj (calibration.TOKENS_PER_INPUT)
                calibration_blocks=24,
                calibration_block_size=256,
                settings=((4, 64),),
                awq_calibration_blocks=2,  # 512 tokens and alpha in {0, 0.5}: the code path, in 11 s
                awq_grid=2,
                gptq_act_order=False,
            ),
            lora=LoRA(steps=2, batch_size=2, max_length=128, eval_examples=3, ranks=(8,)),
            scale=Scale(hidden=128, layers=2, batch=2, seq=64, steps=20),
            profiling=Profiling(
                steps=2,
                compile=False,  # CI: 33 s of inductor compilation for one comparison
            ),
        ),
        Profile(
            name="cpu",
            description="a laptop or a 2-core VM: minutes per lab, the real model",
            timing=Timing(matmul_sizes=(128, 256, 512, 1024, 2048), copy_megabytes=(1, 16, 64), warmup=2, repeats=5),
            eval=Evaluation(documents=64, max_length=512, max_new_tokens=48),
            bpe=Bpe(
                vocab_sizes=(1024, 4096, 16384),
                documents=9_053,  # all that cleaning keeps (the same documents as before at 100,000)
            ),
            loader=Loader(workers=(0, 1, 2), batches=100),
            train=Training(block_size=256, batch_size=8, hidden=256, layers=4, steps=40),
            prune=Pruning(
                sparsities=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7),  # beyond 70 % the model is gone: core time
                ratios=(0.1, 0.2, 0.3),
                calibrated_sparsities=(0.3, 0.5, 0.7, (2, 4)),
                calibration_blocks=16,  # 8192 tokens, as benchmarks/pruning_calibrated.py
                calibration_sizes=(1, 4, 16),
                sensitivity_documents=8,
            ),
            finetune=FineTuning(block_size=128, batch_size=4, steps=40),
            quant=Quantization(
                calibration_blocks=32,
                calibration_block_size=512,
                settings=((4, 64), (4, -1), (3, 64), (3, -1)),
                awq_calibration_blocks=16,
                awq_grid=20,
                gptq_act_order=True,
            ),
            lora=LoRA(steps=30, batch_size=4, max_length=256, eval_examples=40, ranks=(4, 8, 16)),
            scale=Scale(hidden=256, layers=8, batch=4, seq=128, steps=60),
            profiling=Profiling(steps=3, compile=True),
        ),
        Profile(
            name="gpu",
            description="one CUDA GPU: the largest sizes the offline data holds, minutes per lab",
            timing=Timing(
                matmul_sizes=(512, 1024, 2048, 4096, 8192, 16384),
                copy_megabytes=(1, 16, 256, 1024),
                warmup=5,
                repeats=20,
            ),
            eval=Evaluation(
                documents=480,  # of the 491 validation articles
                max_length=512,
                max_new_tokens=64,
            ),
            bpe=Bpe(
                vocab_sizes=(1024, 4096, 16384),
                documents=9_053,  # all that cleaning keeps
            ),
            loader=Loader(workers=(0, 2, 4, 8), batches=100),
            # 16 x 512 tokens a step: lab 01's loader holds 117 batches after the warm-up; lab 02's 100
            # steps take 1,600 of the train split's 1,864 blocks, lab 04's 50 steps 200 of each rank's 205.
            train=Training(block_size=512, batch_size=16, hidden=768, layers=12, steps=100),
            prune=Pruning(
                sparsities=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
                ratios=(0.1, 0.2, 0.3, 0.4),
                calibrated_sparsities=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, (2, 4)),
                calibration_blocks=48,  # 49 k tokens: the gpu calibration windows
                calibration_sizes=(1, 4, 16, 48),
                sensitivity_documents=64,
            ),
            finetune=FineTuning(
                block_size=512,
                batch_size=8,
                steps=200,  # 1,600 of the train split's 1,864 blocks of 512: no block seen twice
            ),
            # Lab 07 scores GPTQ on as many held-out windows from the validation split (53 k tokens) as it
            # calibrates on: 48 x 1024 of its 51 windows. The paper's 128 x 2048 (262 k) exceeds it.
            quant=Quantization(
                calibration_blocks=48,
                calibration_block_size=1024,
                settings=((4, 64), (4, -1), (3, 64), (3, -1)),
                awq_calibration_blocks=16,
                awq_grid=20,
                gptq_act_order=True,
            ),
            lora=LoRA(steps=200, batch_size=16, max_length=384, eval_examples=200, ranks=(4, 8, 16, 64)),
            scale=Scale(hidden=768, layers=12, batch=4, seq=256, steps=80),
            profiling=Profiling(steps=5, compile=True),
        ),
    )
}


def detect_profile_name() -> str:
    """The profile this machine gets without an override: 'gpu' with CUDA, else 'cpu'."""
    import torch  # only to auto-detect: a named profile ($LABKIT_PROFILE) is read without importing torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def get_profile(name: str | None = None) -> Profile:
    """Return the named profile, else $LABKIT_PROFILE, else the auto-detected one."""
    chosen = name or os.environ.get(ENV_VAR) or detect_profile_name()
    key = chosen.strip().lower()
    if key not in PROFILES:
        source = "argument" if name else f"${ENV_VAR}"
        raise ValueError(f"unknown profile {chosen!r} (from {source}); choose one of: {', '.join(PROFILES)}")
    return PROFILES[key]


def for_device(profile: Profile, device_type: str) -> Profile:
    """The profile whose sizes fit where work runs: the `cpu` profile's for ranks that a `gpu`-profile lab puts on the
    CPU (a node with fewer GPUs than ranks: `launch.placement`), else `profile` itself. Only the sizes change."""
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a profiles.Profile (get_profile()), got {type(profile).__name__}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda' (a launch.Placement's), got {device_type!r}")
    return PROFILES["cpu"] if profile.name == "gpu" and device_type == "cpu" else profile


def describe(profile: Profile) -> str:
    """A short multi-line description of a profile's sizes, section by section, for notebooks and `labkit doctor`."""
    lines = [f"profile {profile.name!r}: {profile.description}"]
    for part in fields(profile)[2:]:
        section = getattr(profile, part.name)
        lines.append(f"  {part.name}:")
        lines += [f"    {f.name} = {getattr(section, f.name)}" for f in fields(section)]
    return "\n".join(lines)
