"""In fp32 training DeepSpeed's optimizer steps the parameters themselves, not a copy of them.

DeepSpeed keeps an fp32 master partition for its optimizer beside the parameters. With 16-bit
parameters it must; with fp32 parameters the copy holds the same numbers, 4 bytes per parameter
over N (a quarter of ZeRO-3's model states at N = 4, a third of ZeRO-1/2's optimizer states):

- **ZeRO-3** means the master to *be* the parameter partition when the two agree in dtype and
  device (``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions``: "we don't need another copy
  of the weights"), but DeepSpeed 0.19 tests that with ``tensor.device == self.device``, a
  ``torch.device`` against the accelerator's device *name* (``"cpu"``, ``"cuda:0"``), which
  torch 2.13 answers False. So every fp32 ZeRO-3 rank held its partition twice (measured: 69 MiB
  at 72.8M parameters, dp=4). Each sub-group's clone is replaced by its parameter partition (its
  ``ds_id`` kept); the optimizer's param groups take the masters from that list at each step.
- **ZeRO-1/2** always clone this rank's part of each flat parameter group
  (``single_partition_of_fp32_groups``). In fp32 that part of the flat parameters is stepped
  instead (a tensor over the same memory): it becomes the torch optimizer's parameter, and
  DeepSpeed's links from each
  parameter to its fragment of the master (``_hp_mapping``, read by ``safe_get_full_fp32_param``
  and checkpoints) are made again over it.

:func:`share_fp32_partitions` does both after ``deepspeed.initialize``, before any step (the
optimizer states are made at the first step, so nothing else held the clones, which are then
freed with the placeholder gradients DeepSpeed hung on them). The step updates the parameters in
place and DeepSpeed's copy of the master back into them is a copy onto itself; the all-gather
after a ZeRO-1/2 step already reads this rank's part from the flat parameters. The same numbers
as before. 16-bit training and offloaded optimizers keep their fp32 masters.
"""

from __future__ import annotations

import torch


def share_fp32_partitions(zero_optimizer) -> int:
    """Replace DeepSpeed's fp32 master copies that equal their parameter partition in dtype,
    device and size by that partition; returns the bytes freed (0 for stage 0, offloaded or
    swapped optimizers and 16-bit parameters)."""
    if getattr(zero_optimizer, "offload_optimizer", False) or getattr(
        zero_optimizer, "cpu_offload", False
    ):
        return 0
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return _share_stage_3(zero_optimizer)
    if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        return _share_stage_1_2(zero_optimizer)
    return 0


def _same(low: torch.Tensor | None, master: torch.Tensor) -> bool:
    return (
        low is not None
        and low is not master
        and low.dtype == master.dtype
        and low.device == master.device
        and low.shape == master.shape
    )


def _share_stage_3(zero) -> int:
    masters, freed = zero.fp32_partitioned_groups_flat, 0
    for i, (low, master) in enumerate(zip(zero.fp16_partitioned_groups_flat, masters)):
        if _same(low, master):
            low.ds_id = master.ds_id
            low.requires_grad = True  # as DeepSpeed marks every master
            masters[i] = low
            freed += master.numel() * master.element_size()
    return freed


def _share_stage_1_2(zero) -> int:
    import torch.distributed as dist

    masters, freed = zero.single_partition_of_fp32_groups, 0
    for i, master in enumerate(masters):
        rank = dist.get_rank(group=zero.real_dp_process_group[i])
        # this rank's part of the flat parameters, as a tensor of its own over the same memory
        # (not a view: the all-gather after each step writes the flat parameters in place)
        low = zero.parallel_partitioned_bit16_groups[i][rank].detach()
        stepped = zero.optimizer.param_groups[i]["params"]
        if _same(low, master) and len(stepped) == 1 and stepped[0] is master:
            low.requires_grad = True  # as DeepSpeed marks every master
            masters[i] = low
            zero.optimizer.param_groups[i]["params"] = [low]
            freed += master.numel() * master.element_size()
    if freed:
        zero._link_all_hp_params()  # each parameter's fragment of its master, over the views
    return freed
