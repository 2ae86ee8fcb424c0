"""The engine's tuning switches, in one object passed to the engine.

Each switch names an optimisation whose gain was measured on one backend and not on
another (docs/performance.md); ``None`` means "where it measured faster", decided when
the options are resolved for the backend MLX runs on. Setting a switch forces it, which is
how the tests run the GPU's paths on the CPU and how an optimisation is measured against
its absence. No setting changes a greedy float32 token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .device import on_cuda, on_gpu

CPU_COMPILED_BLOCK = 8  # the longest block compiled on the CPU: longer ones measured slower compiled there


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a cycle (the output never depends on it).

    queue_ahead: queue each greedy block before reading the previous one's accept count,
        where every cache of the target can be cut by a count still on the device (GPUs).
    compile_blocks: verify blocks under ``mx.compile`` (GPUs: every block; the CPU: blocks
        of up to ``CPU_COMPILED_BLOCK`` tokens). True/False: every block or none.
    pad_reads: blocks read whole 256-position key buffers, masked, so the kernel shapes
        repeat (GPUs).
    pack_projections: compiled blocks run q/k/v and gate/up as one matmul each.
    rowwise_products: compiled blocks of one sequence (not a batch's) run plain projections row
        by row, as mlx-lm's one-token step does (GPUs, models of up to ``projections.ROWWISE_MAX_BYTES``).
    compile_draft: draft passes under ``mx.compile`` (None: on GPUs; default off, not shown faster).
    pack_draft: draft passes pack their projections as compiled blocks do (GPUs).
    prefill_step: prompt tokens per prefill chunk (mlx-lm's default).
    device_trees: greedy trees built, walked and rolled back on the device, queued ahead as
        blocks are (GPUs; False: built and walked on the host, each cycle read before the next).
    pad_rows: a batch keeps a power-of-two number of rows, a finished row's slot idle until a
        new row takes it (GPUs: a row costs little there, and each new row count is a new trace
        of the compiled verify; a leave then reads the queued cycle early only to keep a hybrid
        target's recurrent state in a prefix cache).
    join_behind: a row that joins a batch while a cycle is queued is prefilled behind it, nothing
        read as it joins; the next step reads its first token and it merges into the cycle after
        (GPUs; off: the queued cycle is read first, then the row prefilled and merged).
    draft_vocab: greedy drafts pick among the draft's vocabulary, where it has one, through a
        head of just those rows (a smaller head: the CPU, Apple GPUs); off: among every id,
        through the whole head (NVIDIA GPUs: as fast a cycle there, and a few drafts more accepted).
    """

    queue_ahead: Optional[bool] = None
    compile_blocks: Optional[bool] = None
    pad_reads: Optional[bool] = None
    pack_projections: bool = True
    rowwise_products: Optional[bool] = None
    compile_draft: Optional[bool] = False
    pack_draft: Optional[bool] = None
    prefill_step: int = 2048
    device_trees: Optional[bool] = None
    pad_rows: Optional[bool] = None
    join_behind: Optional[bool] = None
    draft_vocab: Optional[bool] = None

    def resolved(self) -> "EngineOptions":
        """These options with every ``None`` decided for the backend MLX runs on now
        (``rowwise_products`` stays None: it also depends on the model's size)."""
        gpu = on_gpu()

        def pick(value: Optional[bool]) -> bool:
            return gpu if value is None else value

        return replace(self, queue_ahead=pick(self.queue_ahead), pad_reads=pick(self.pad_reads),
                       compile_draft=pick(self.compile_draft), pack_draft=pick(self.pack_draft),
                       device_trees=pick(self.device_trees), pad_rows=pick(self.pad_rows),
                       join_behind=pick(self.join_behind),
                       draft_vocab=not on_cuda() if self.draft_vocab is None else self.draft_vocab)

    def longest_compiled_block(self, padded_block: int) -> int:
        """Blocks of 2..this many tokens run compiled (0: none)."""
        if self.compile_blocks is None:
            return padded_block if on_gpu() else CPU_COMPILED_BLOCK
        return padded_block if self.compile_blocks else 0


DEFAULT_OPTIONS = EngineOptions()
