"""A torchrun job whose ranks start, leave their pid in READY_DIR, and wait forever: the orphan tests
end it in the ways a real job ends.

    torchrun --nproc_per_node=2 tests/scripts/hold_ranks.py READY_DIR
"""

import os
import sys
import time
from pathlib import Path

from labkit.parallel.launch import rank_context

with rank_context() as (rank, world, device):
    ready = Path(sys.argv[1])
    (ready / f".rank{rank}").write_text(str(os.getpid()))
    (ready / f".rank{rank}").rename(ready / f"rank{rank}.pid")
    while True:
        time.sleep(1)
