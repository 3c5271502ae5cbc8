"""Exercise checks: each compares a student's function with labkit's own implementation of the same step.

A check runs the function on a few cases chosen to catch the usual mistakes, and raises `CheckFailed`
(an AssertionError, so a notebook cell stops there) with the smallest failing case, what was
expected, what came back, and a hint. A function that still raises NotImplementedError (the stub of
the student build) gets a message saying which exercise is left, not a traceback.

One module per lab (`lab00` … `lab10`), each importing only the labkit modules its checks compare with,
and `core` for what they share. The notebooks call every check as `checks.check_...`, and `checks.reveal` after a
measurement the student was asked to predict: re-exported here.
"""

from labcourse.checks.core import CheckFailed, reveal
from labcourse.checks.lab00 import check_median_time, check_windows
from labcourse.checks.lab01 import check_merge_pair, check_pack_blocks
from labcourse.checks.lab02 import check_kept_fraction, check_update_loss_scale
from labcourse.checks.lab03 import check_loss_divisors, check_lr_at
from labcourse.checks.lab04 import check_all_gather_step, check_reduce_scatter_step
from labcourse.checks.lab05 import check_1f1b_order, check_bubble_fraction
from labcourse.checks.lab06 import check_nm_mask, check_overall_sparsity
from labcourse.checks.lab07 import check_gptq_column, check_pack_nibbles
from labcourse.checks.lab08 import check_lora_forward, check_lora_merge
from labcourse.checks.lab09 import check_zero1_step, check_zero_bytes
from labcourse.checks.lab10 import check_joules_per_token, check_matmul_share

__all__ = [
    "CheckFailed",
    "reveal",
    "check_median_time",
    "check_windows",
    "check_merge_pair",
    "check_pack_blocks",
    "check_update_loss_scale",
    "check_kept_fraction",
    "check_loss_divisors",
    "check_lr_at",
    "check_reduce_scatter_step",
    "check_all_gather_step",
    "check_1f1b_order",
    "check_bubble_fraction",
    "check_nm_mask",
    "check_overall_sparsity",
    "check_gptq_column",
    "check_pack_nibbles",
    "check_lora_forward",
    "check_lora_merge",
    "check_zero_bytes",
    "check_zero1_step",
    "check_matmul_share",
    "check_joules_per_token",
]
