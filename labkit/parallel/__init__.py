"""Training across processes and GPUs, one module per idea (labs 04, 05 and 09):

- `launch`: where the ranks run (a GPU each on NCCL, else CPU on gloo), `rank_context` inside a torchrun
  worker, and `launch`, the torchrun launcher a notebook calls. The base: the others may import it.
- `data`: data parallelism from scratch (naive, bucketed and overlapped with backward) next to torch DDP.
- `ring`: the ring all-reduce, simulated in one process and built from point-to-point sends.
- `tensor`: Megatron-style tensor parallelism: one MLP (lab 05), a Llama decoder block by hand and by DTensor (lab 09).
- `pipeline`: Llama pipeline stages, GPipe / 1F1B orders, timelines and the bubble.
- `slurm`: an sbatch script that runs torchrun on many nodes.
- `memory`: what one rank holds under DDP, ZeRO-1/2/3, activation checkpointing and offload (lab 09).
- `zero`: ZeRO-1 from scratch, AdamW's state sharded over the ranks (lab 09).
- `comm`: bytes per collective, counted where torch calls them; gradient compression for DDP (lab 09).
- `fsdp`: FSDP2 (ZeRO-3) on a decoder, a unit per block (lab 09).
"""
