"""Run profiles: one table of sizes, so every lab runs the same code on CI, a laptop or a GPU.

Every size draws on the offline corpus, which is small: 9,058 train articles (955 k SmolLM2 tokens, 9,053
left after lab 01's cleaning) and 491 validation articles (53 k tokens). No profile asks for more than
that holds; tests/test_profiles.py recomputes what each lab draws against the data, for every profile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ENV_VAR = "LABKIT_PROFILE"


@dataclass(frozen=True)
class Profile:
    """Sizes a lab takes from the profile; the code path never depends on the profile's name."""

    name: str
    description: str
    matmul_sizes: tuple[int, ...]  # square matmul sizes for the throughput sweep (lab 00)
    copy_megabytes: tuple[int, ...]  # host<->device copy sizes (lab 00, GPU only)
    bench_warmup: int  # untimed calls before timing
    bench_repeats: int  # timed calls; the median is reported
    eval_documents: int  # validation documents scored for perplexity
    eval_max_length: int  # perplexity window length in tokens
    max_new_tokens: int  # generation length in demos
    bpe_vocab_sizes: tuple[int, ...]  # own BPE tokenizers trained in lab 01
    bpe_train_documents: int  # cleaned wiki train documents they are trained on
    block_size: int  # tokens per training block
    batch_size: int  # blocks per batch
    loader_workers: tuple[int, ...]  # DataLoader worker counts compared in lab 01
    loader_batches: int  # batches timed per loader measurement
    lm_hidden: int  # width of the small Llama trained from scratch in labs 02-03
    lm_layers: int  # its depth
    train_steps: int  # optimizer steps per training run in labs 02-03
    prune_sparsities: tuple[float, ...]  # unstructured sparsities swept in lab 06
    prune_ratios: tuple[float, ...]  # shares of MLP channels removed by structured pruning (lab 06)
    calibrated_sparsities: tuple[float | tuple[int, int], ...]  # pruned by Wanda and SparseGPT in lab 06; (n, m): N:M
    prune_calibration_blocks: int  # their calibration windows, of calibration_block_size tokens
    prune_calibration_sizes: tuple[int, ...]  # windows tried for Wanda's calibration-size sensitivity (lab 06)
    sensitivity_documents: int  # validation documents scored per sensitivity probe (lab 06)
    finetune_block_size: int  # tokens per block when fine-tuning the default model (labs 06-08)
    finetune_batch_size: int  # blocks per fine-tuning batch
    finetune_steps: int  # optimizer steps of a fine-tuning run
    calibration_blocks: int  # GPTQ calibration windows (lab 07); the paper used 128
    calibration_block_size: int  # tokens per calibration window; the paper used 2048
    quant_settings: tuple[tuple[int, int], ...]  # (bits, group size) compared whole-model in lab 07; -1 = per channel
    awq_calibration_blocks: int  # windows for lab 07's activation-aware scales (statistics, not a full-rank Hessian)
    awq_grid: int  # exponents α tried per layer group by lab 07's activation-aware scales (AWQ used 20)
    gptq_act_order: bool  # lab 07's landscape runs GPTQ again with act-order (False: it reuses the table's GPTQ run)
    lora_steps: int  # optimizer steps per fine-tuning run in lab 08 (each example seen once)
    lora_batch_size: int  # task examples per step
    lora_max_length: int  # tokens per example (prompt cut from the left)
    lora_eval_examples: int  # held-out validation articles scored per run
    lora_ranks: tuple[int, ...]  # LoRA ranks compared on q/v
    scale_hidden: int  # width of lab 09's SmolLM2-shaped model (head_dim 64, SmolLM2's vocabulary)
    scale_layers: int  # its depth
    scale_batch: int  # sequences per rank per step in lab 09
    scale_seq: int  # tokens per sequence in lab 09
    scale_steps: int  # steps per gradient-compression loss curve (lab 09); every rank reads its own blocks
    profiled_steps: int  # steps recorded by the profiler in lab 10 (after one wait and one warm-up step)
    compile_steps: bool  # lab 10 compiles the step with torch.compile (about 30 s of compiling on a 2-core CPU)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="smoke",
            description="CI: seconds per lab, tiny sizes, same code path",
            matmul_sizes=(64, 128, 256),
            copy_megabytes=(1, 8),
            bench_warmup=1,
            bench_repeats=3,
            eval_documents=4,
            eval_max_length=256,
            max_new_tokens=16,
            bpe_vocab_sizes=(300, 512),
            bpe_train_documents=300,
            block_size=64,
            batch_size=4,
            loader_workers=(0, 1),
            loader_batches=10,
            lm_hidden=64,
            lm_layers=2,
            train_steps=8,
            prune_sparsities=(0.0, 0.5, 0.9),
            prune_ratios=(0.2,),
            calibrated_sparsities=(0.5,),
            prune_calibration_blocks=2,
            prune_calibration_sizes=(1, 2),
            sensitivity_documents=1,
            finetune_block_size=64,
            finetune_batch_size=2,
            finetune_steps=2,
            calibration_blocks=24,  # 6144 tokens: 4x the 1536 inputs of SmolLM2's down_proj (quant.TOKENS_PER_INPUT)
            calibration_block_size=256,
            quant_settings=((4, 64),),
            awq_calibration_blocks=2,  # 512 tokens and alpha in {0, 0.5}: the code path, in 11 s
            awq_grid=2,
            gptq_act_order=False,
            lora_steps=2,
            lora_batch_size=2,
            lora_max_length=128,
            lora_eval_examples=3,
            lora_ranks=(8,),
            scale_hidden=128,
            scale_layers=2,
            scale_batch=2,
            scale_seq=64,
            scale_steps=20,
            profiled_steps=2,
            compile_steps=False,  # CI: 33 s of inductor compilation for one comparison
        ),
        Profile(
            name="cpu",
            description="a laptop or a 2-core VM: minutes per lab, the real model",
            matmul_sizes=(128, 256, 512, 1024, 2048),
            copy_megabytes=(1, 16, 64),
            bench_warmup=2,
            bench_repeats=5,
            eval_documents=64,
            eval_max_length=512,
            max_new_tokens=48,
            bpe_vocab_sizes=(1024, 4096, 16384),
            bpe_train_documents=9_053,  # all that cleaning keeps (the same documents as before at 100,000)
            block_size=256,
            batch_size=8,
            loader_workers=(0, 1, 2),
            loader_batches=100,
            lm_hidden=256,
            lm_layers=4,
            train_steps=40,
            prune_sparsities=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
            prune_ratios=(0.1, 0.2, 0.3),
            calibrated_sparsities=(0.3, 0.5, 0.7, (2, 4)),
            prune_calibration_blocks=16,  # 8192 tokens, as benchmarks/pruning_calibrated.py
            prune_calibration_sizes=(1, 4, 16),
            sensitivity_documents=8,
            finetune_block_size=128,
            finetune_batch_size=4,
            finetune_steps=40,
            calibration_blocks=32,
            calibration_block_size=512,
            quant_settings=((4, 64), (4, -1), (3, 64), (3, -1)),
            awq_calibration_blocks=16,
            awq_grid=20,
            gptq_act_order=True,
            lora_steps=30,
            lora_batch_size=4,
            lora_max_length=256,
            lora_eval_examples=40,
            lora_ranks=(4, 8, 16),
            scale_hidden=256,
            scale_layers=8,
            scale_batch=4,
            scale_seq=128,
            scale_steps=60,
            profiled_steps=3,
            compile_steps=True,
        ),
        Profile(
            name="gpu",
            description="one CUDA GPU: the largest sizes the offline data holds, minutes per lab",
            matmul_sizes=(512, 1024, 2048, 4096, 8192, 16384),
            copy_megabytes=(1, 16, 256, 1024),
            bench_warmup=5,
            bench_repeats=20,
            eval_documents=480,  # of the 491 validation articles
            eval_max_length=512,
            max_new_tokens=64,
            bpe_vocab_sizes=(1024, 4096, 16384),
            bpe_train_documents=9_053,  # all that cleaning keeps
            # 16 x 512 tokens a step: lab 01's loader holds 117 batches after the warm-up; lab 02's 100
            # steps take 1,600 of the train split's 1,864 blocks, lab 04's 50 steps 200 of each rank's 205.
            block_size=512,
            batch_size=16,
            loader_workers=(0, 2, 4, 8),
            loader_batches=100,
            lm_hidden=768,
            lm_layers=12,
            train_steps=100,
            prune_sparsities=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
            prune_ratios=(0.1, 0.2, 0.3, 0.4),
            calibrated_sparsities=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, (2, 4)),
            prune_calibration_blocks=48,  # 49 k tokens: the gpu calibration windows
            prune_calibration_sizes=(1, 4, 16, 48),
            sensitivity_documents=64,
            finetune_block_size=512,
            finetune_batch_size=8,
            finetune_steps=200,  # 1,600 of the train split's 1,864 blocks of 512: no block seen twice
            # Lab 07 scores GPTQ on as many held-out windows from the validation split (53 k tokens) as it
            # calibrates on: 48 x 1024 of its 51 windows. The paper's 128 x 2048 (262 k) exceeds it.
            calibration_blocks=48,
            calibration_block_size=1024,
            quant_settings=((4, 64), (4, -1), (3, 64), (3, -1)),
            awq_calibration_blocks=16,
            awq_grid=20,
            gptq_act_order=True,
            lora_steps=200,
            lora_batch_size=16,
            lora_max_length=384,
            lora_eval_examples=200,
            lora_ranks=(4, 8, 16, 64),
            scale_hidden=768,
            scale_layers=12,
            scale_batch=4,
            scale_seq=256,
            scale_steps=80,
            profiled_steps=5,
            compile_steps=True,
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


def describe(profile: Profile) -> str:
    """A short multi-line description of a profile's sizes, for notebooks and `labkit doctor`."""
    lines = [f"profile {profile.name!r}: {profile.description}"]
    lines += [f"  {f.name} = {getattr(profile, f.name)}" for f in fields(profile)[2:]]
    return "\n".join(lines)
