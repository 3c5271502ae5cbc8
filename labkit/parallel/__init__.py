"""Training across processes and GPUs, one module per idea (labs 04 and 05):

- `launch`: where the ranks run (a GPU each on NCCL, else CPU on gloo), `rank_context` inside a torchrun
  worker, and `launch`, the torchrun launcher a notebook calls. The base: the others may import it.
- `data`: data parallelism from scratch (naive, bucketed and overlapped with backward) next to torch DDP.
- `ring`: the ring all-reduce, simulated in one process and built from point-to-point sends.
- `tensor`: Megatron-style tensor parallelism of one MLP.
- `pipeline`: Llama pipeline stages, GPipe / 1F1B orders, timelines and the bubble.
- `slurm`: an sbatch script that runs torchrun on many nodes.
"""
