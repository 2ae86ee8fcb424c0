"""DFlash over a target sharded across processes with MLX's distributed layer (``mlx.launch``).

mlx-lm shards a model tensor-parallel (each family's ``shard()``): every process holds a slice of
each projection, and the reductions after attention and the MLP leave the residual stream whole
on every process, so the tapped hidden states and the logits are the same everywhere. The draft
runs replicated on them. Every process then drafts, verifies and accepts the same tokens, as
long as everything else a decision reads is shared too: the adaptive policy's timings come from
process 0 (``from_rank_zero``), sampling draws from one shared seed (``shared_seed``), and each
generation ends with a check that all processes committed the same tokens (``check_agreement``).
Process 0 alone prints, writes and serves; in ``serve`` the others follow its requests
(``send_job`` / ``receive_job``).

A family mlx-lm pipelines instead (Qwen3-Next: each process holds some of the layers, the
hidden state passed from stage to stage and the last stage's output gathered to all) runs
pipeline-parallel: each process has the tapped outputs of its own layers only, and a sum over
the processes (zeros elsewhere, so exact) gives every process all of them (``Target``).
"""

from __future__ import annotations

import json
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import DFlashError

Group = mx.distributed.Group
# Families the engine supports whose mlx-lm model has ``shard()`` (tested: tests/test_sharded.py).
TENSOR_PARALLEL = {"llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss"}
# Families mlx-lm pipelines (``model.model.pipeline()``) but cannot shard tensor-parallel.
PIPELINE_PARALLEL = {"qwen3_next"}


def world() -> Optional[Group]:
    """The group of processes ``mlx.launch`` started (None for a single process)."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def pipeline_stages(model: nn.Module) -> int:
    """How many processes a model's layers are pipelined over (1: not pipelined)."""
    return getattr(getattr(model, "model", None), "pipeline_size", 1)


def sharding_group(model: nn.Module) -> Optional[Group]:
    """The group a model's layers are sharded over (None: not sharded)."""
    if pipeline_stages(model) > 1:
        return mx.distributed.init()  # (mlx-lm's stages talk over the global group)
    for module in model.modules():
        group = getattr(module, "group", None) or getattr(module, "sharding_group", None)
        if isinstance(group, Group) and group.size() > 1:
            return group
    return None


def describe(model: nn.Module, group: Group) -> str:
    kind = "pipeline" if pipeline_stages(model) > 1 else "tensor"
    return f"{kind}-parallel over {group.size()} processes"


def check_shardable(family: str, group: Group) -> None:
    if family not in TENSOR_PARALLEL | PIPELINE_PARALLEL:
        raise DFlashError(f"a {family} target cannot be sharded over {group.size()} processes: mlx-dflash shards "
                          f"{', '.join(sorted(TENSOR_PARALLEL))} (tensor parallel, through mlx-lm's shard()) and "
                          f"{', '.join(sorted(PIPELINE_PARALLEL))} (pipeline parallel, through mlx-lm's pipeline())")


def shard(model: nn.Module, family: str, group: Group) -> None:
    """Split a (lazily loaded) model over ``group`` the way mlx-lm offers for its family."""
    check_shardable(family, group)
    if family in TENSOR_PARALLEL:
        model.shard(group)
    else:
        model.model.pipeline(group)


def _sum(array: mx.array, group: Group) -> mx.array:
    total = mx.distributed.all_sum(array, group=group, stream=mx.cpu)
    mx.eval(total)
    return total


def from_rank_zero(seconds: Optional[float], group: Group) -> Optional[float]:
    """Process 0's value everywhere (the policy's timings: each process measures its own; None:
    not timed)."""
    mine = (-1.0 if seconds is None else seconds) if group.rank() == 0 else 0.0
    value = _sum(mx.array(mine, mx.float32), group).item()
    return None if value < 0 else value


def shared_seed(group: Group) -> int:
    """A random seed drawn by process 0, the same in every process."""
    seed = int(np.random.default_rng().integers(0, 2**31 - 1)) if group.rank() == 0 else 0
    return int(_sum(mx.array(seed, mx.int32), group).item())


def check_agreement(tokens: list[int], group: Group) -> None:
    """Fail loudly if the processes committed different tokens (they must never diverge)."""
    def gathered(x: mx.array) -> mx.array:
        return mx.distributed.all_gather(x, group=group, stream=mx.cpu)

    lengths = gathered(mx.array([len(tokens)])).tolist()
    if len(set(lengths)) == 1:
        ours = mx.array(tokens or [0], mx.int32)[None]
        if bool(mx.all(gathered(ours) == ours).item()):
            return
    raise DFlashError(f"the {group.size()} processes generated different tokens (lengths {lengths}): "
                      "a sharded run must take the same decisions everywhere")


def send_job(job: Optional[dict], group: Group) -> None:
    """Process 0: what every other process must generate next (None: stop)."""
    payload = np.frombuffer(json.dumps(job).encode(), dtype=np.uint8)
    _sum(mx.array([payload.size], mx.int32), group)
    _sum(mx.array(payload.astype(np.int32)), group)


def receive_job(group: Group) -> Optional[dict]:
    """The other processes: the next job process 0 sent (blocks until it sends one)."""
    size = int(_sum(mx.zeros((1,), mx.int32), group).item())
    payload = np.array(_sum(mx.zeros((size,), mx.int32), group)).astype(np.uint8)
    return json.loads(payload.tobytes().decode())
