"""The draft model of speculative_method draft: its weights, its K/V pool, and its drafting.

The draft's pool mirrors the model's blocks and block tables (shaped for the draft's layers and heads),
plus scratch blocks where draft steps write past a request's blocks. The draft runs over every
iteration's tokens (``follow``) so its keys and values track the model's, then drafts each asking
request's next tokens (``propose``). One worker only (EngineConfig refuses parallelism with a draft).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orca.checkpoint import ModelConfig, resolve_checkpoint
from orca.config import EngineConfig
from orca.core.plan import PlannedRequest, SamplingSpec, StepResult
from orca.core.speculative import check_draft_model
from orca.models.attention import AttentionMetadata, IterationLayout, PhaseTimer
from orca.models.device import upload
from orca.worker.kv_cache import KVLayout
from orca.worker.resolution import ResolvedPlan, check_attention_support
from orca.worker.sampler import SamplingTensors, sample

logger = logging.getLogger(__package__)  # "orca.worker": the worker's lines, whichever module says them


@dataclass
class _Drafting:
    """A request the draft model drafts for in this iteration (DraftModel.propose): its latest token, at
    `position`, is fed next; the token drawn there is its output token number `step`; `k` steps in all,
    over `table` (its block table, and scratch blocks past it)."""

    request_id: str
    sampling: SamplingSpec
    token: int
    position: int
    step: int
    k: int
    table: list[int]


class DraftModel:
    """The draft model (EngineConfig.speculative_model) and its K/V pool (``pool``, ``scales``), which the
    worker allocates beside its own (``allocate``) and zeroes alike (``zero_blocks``)."""

    def __init__(self, model: torch.nn.Module, layout: KVLayout, scratch_blocks: int,
                 attention: type[AttentionMetadata], device: torch.device) -> None:
        self.model = model
        self.layout = layout
        self.scratch_blocks = scratch_blocks
        self.attention = attention
        self.device = device
        self.pool: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.scratch_first = 0  # the first scratch block's id in the pool

    @classmethod
    def load(cls, config: EngineConfig, backends: ResolvedPlan, dtype: torch.dtype, device: torch.device,
             target: ModelConfig, target_layout: KVLayout, max_len: int, load_model: Callable) -> DraftModel:
        """The draft model, loaded like the model (dtype, linear backend, quantization) and checked
        against its config (`target`), and the layout of its K/V pool."""
        checkpoint = resolve_checkpoint(config.speculative_model)
        model, dc = load_model(checkpoint, dtype, device, None, backends.linear, config.quantization,
                               config.quantization_group_size)
        check_draft_model(dc, target, max_len, checkpoint)
        check_attention_support(backends.attention, device, dc.head_dim, backends.kv_dtype,
                                whose="the draft model's (speculative_model)")
        layout = KVLayout(dc.num_layers, dc.num_kv_heads, dc.head_dim, backends.kv_dtype, config.block_size)
        # Draft steps write up to num_speculative_tokens positions past what a request's blocks hold:
        # at most that many blocks more, for each of max_bs requests.
        scratch_blocks = config.max_bs * -(-config.num_speculative_tokens // config.block_size)
        logger.info("speculative_method draft: %s (%d layers, %d bytes per token of K/V beside the model's %d)",
                    checkpoint, dc.num_layers, layout.bytes_per_slot, target_layout.bytes_per_slot)
        return cls(model, layout, scratch_blocks, backends.attention, device)

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_blocks * self.layout.bytes_per_block

    # -- its pool ---------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, zeroed: bool) -> None:
        """The pool over the model's `num_blocks` blocks, then the scratch blocks (zeroed: a backend reading
        whole blocks needs finite numbers in the slots it masks)."""
        layout, total = self.layout, num_blocks + self.scratch_blocks
        self.pool = layout.allocate(total, self.device, zeroed=zeroed)
        self.scales = layout.allocate_scales(total, self.device, zeroed=zeroed)
        self.scratch_first = num_blocks
        if not zeroed:
            scratch = torch.arange(num_blocks, total, dtype=torch.int64, device=self.device)
            layout.zero_blocks(self.pool, scratch, self.scales)

    def release(self) -> None:
        self.pool = self.scales = None

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Zeroes the blocks the model's pool zeroes (fresh blocks of a backend that reads whole blocks)."""
        self.layout.zero_blocks(self.pool, block_ids, self.scales)

    # -- the iteration -----------------------------------------------------------------------------
    def follow(self, ids: torch.Tensor, pos: torch.Tensor, ordered: list[PlannedRequest], tables: list[list[int]],
               layout: IterationLayout, timer: PhaseTimer | None) -> None:
        """Runs the draft over the iteration's tokens (`ids`, `pos`, padding rows left out) so it has keys
        and values of every token the model has; `tables` are the ordered requests' block tables."""
        self.model(ids, pos, self._metadata(ordered, tables, layout, timer))

    def _metadata(self, ordered: list[PlannedRequest], tables: list[list[int]], layout: IterationLayout,
                  timer: PhaseTimer | None) -> AttentionMetadata:
        """The iteration's attention metadata over the draft's pool: the model's with the pool swapped
        (reference, batched), else built again (flex's layout spans the pool; CUDA graphs' padding)."""
        if layout.padded_to is None:
            meta = layout.metadata()
            if meta.flex is None:
                return dataclasses.replace(meta, kv_pool=self.pool, kv_scales=self.scales)
        return self.attention.for_iteration(
            [len(pr.token_ids) for pr in ordered], [pr.start for pr in ordered], tables, self.layout.block_size,
            self.pool, timer, kv_scales=self.scales,
        )

    def propose(self, ordered: list[PlannedRequest], tables: list[list[int]], samplings: list[SamplingSpec],
                result: StepResult) -> None:
        """Drafts the next tokens of each request the plan asks (PlannedRequest.num_to_propose, capped by
        max_tokens) into result.proposals. Step j feeds each drafting request's latest token and draws
        with its sampling options at the output step the model will verify it at: the sampler's noise
        there is the same for both (sampler.py), so a close draft draws what the model will. Scratch
        blocks' keys and values are never read after this iteration."""
        block_size = self.layout.block_size
        scratch, scratch_end = self.scratch_first, self.scratch_first + self.scratch_blocks
        drafting: list[_Drafting] = []
        for pr, table, sampling in zip(ordered, tables, samplings):
            kept = result.sampled.get(pr.request_id)
            if not pr.num_to_propose or not kept:
                continue
            step = pr.sample_step + len(kept)  # the output index of the first drafted token
            k = min(pr.num_to_propose, pr.max_tokens - step - 1)
            if k <= 0:
                continue
            position = pr.start + len(pr.token_ids) - pr.num_proposed + len(kept) - 1  # of the last drawn token
            need = -(-(position + k) // block_size) - len(table)  # blocks the steps write past the table
            if need > 0:
                if scratch + need > scratch_end:
                    raise RuntimeError(f"draft steps need more than the {self.scratch_blocks} scratch blocks")
                table = table + list(range(scratch, scratch + need))
                scratch += need
            drafting.append(_Drafting(pr.request_id, sampling, kept[-1], position, step, k, table))
            result.proposals[pr.request_id] = []
        for j in range(max((d.k for d in drafting), default=0)):
            live = [d for d in drafting if d.k > j]
            meta = self.attention.for_iteration([1] * len(live), [d.position + j for d in live],
                                                [d.table for d in live], block_size, self.pool,
                                                kv_scales=self.scales)
            ids = upload([d.token for d in live], torch.int64, self.device)
            pos = upload([d.position + j for d in live], torch.int64, self.device)
            logits = self.model.compute_logits(self.model(ids, pos, meta))  # (B, V)
            specs, steps = [d.sampling for d in live], [d.step + j for d in live]
            drawn = sample(logits, SamplingTensors.from_specs(specs, steps, self.device)).tolist()  # host sync
            for d, token in zip(live, drawn):
                d.token = token
                result.proposals[d.request_id].append(token)
