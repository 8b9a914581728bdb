"""attention_backend ``flex``: one ``flex_attention`` call per layer for every token of the iteration (prompt
chunks and increments together, grouped-query attention without repeating K/V), reading keys and values
straight from the whole pool, so nothing is gathered and the shapes depend only on the token count (what
CUDA graphs need: orca/worker/cuda_graphs.py). A mask function keeps, for each query, the slots its own
request owns up to its position (and within its sliding window); a block-sparse structure built from the
block tables (FlexLayout) lets the fused kernel skip every block of the pool no query of a tile needs. On
CUDA the call is compiled (Triton) with dynamic token counts, and warmed up at load, never in a user's
request (warm_up_rows); on a CPU it runs PyTorch's unfused flex implementation, which evaluates the mask
over the whole pool: correct, for checking the fused path on a CPU, not fast.

`auto` never picks it: on a CPU flex's paged mask does not compile in torch 2.13 and batched is the fastest
measured; on CUDA (an H200) flex with CUDA graphs was 3.2-6.2x batched's decode tokens/s at batch 1-64 and
0.93x at 256, but it serves without prefix caching, and FlexLayout.build makes (requests x pool tiles) and
(query tiles x pool tiles) tensors every iteration: with a GPU-sized pool (4M slots, 250k tiles, on the
H200) a 77k-token prompt iteration's would be about 1.2 G entries. Choose it with n_slots bounding the pool.

Limits: the pool must be allocated zeroed (zeroed_pool): the kernels weigh every slot of a tile they
visit, the masked ones by 0, and 0 x NaN would poison a row; for the same reason the worker zeroes each
block it hands to a request (reads_whole_blocks). The compiled forward pass of a CPU (orca/worker/
compiled.py) does not run with it. Nor does a quantized pool (kv_cache_dtype fp8_e4m3 or int8: the fused
kernel reads the pool as it is and would need its scales; refused at load, orca/worker/kv_cache.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from orca.models.attention.base import AttentionMetadata, PhaseTimer, token_slots
from orca.models.device import upload

# The flex backend's tiles: FLEX_Q_BLOCK query rows (a tile of increments spans up to this many requests,
# whose blocks its kernel program reads) by at least FLEX_KV_BLOCK pool slots (a whole number of K/V blocks).
FLEX_Q_BLOCK = 16
FLEX_KV_BLOCK = 16
PADDING_ROW = -1  # a padding row's request and position in FlexLayout: it keeps no slot
# Inductor lowers flex_attention to its decoding kernel below this many query rows and to its main kernel
# from there (torch/_inductor/kernel/flex/flex_decoding.py, _use_flex_decoding): a guard on the row count.
FLEX_DECODING_ROWS = 128
FLEX_RECOMPILE_LIMIT = 64  # graphs of compiled flex_attention per process (see _flex_function)
# Inductor's flex kernels need a head dimension of at least this (torch 2.11: "NYI: embedding dimension of the
# query, key, and value must be at least 16"); the worker refuses flex on CUDA below it, at load.
FLEX_MIN_HEAD_DIM = 16


@dataclass(kw_only=True)
class FlexMetadata(AttentionMetadata):
    """The iteration's slots and its FlexLayout (`flex`), which every layer's call reads."""

    name = "flex"
    zeroed_pool = True
    reads_whole_blocks = True
    cuda_graphs = True
    # Token counts are dynamic, but dynamo specialises a few (tests/test_attention_backend.py counts the
    # graphs): two rows, one row (the worker's prompt and increment), one query tile of more rows, several
    # tiles; and inductor's lowering guards on FLEX_DECODING_ROWS (its decoding kernel below that many query
    # rows, its main kernel from there). So after the prompt and its increment: iterations of 5 rows, of more
    # than two tiles and of more than FLEX_DECODING_ROWS.
    warm_up_rows = (5, 2 * FLEX_Q_BLOCK + 1, FLEX_DECODING_ROWS + 1)

    flex: FlexLayout = field()  # (required: the base's None is for the other backends)

    @classmethod
    def for_iteration(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        kv_pool: torch.Tensor,
        timer: PhaseTimer | None = None,
        padding: int = 0,
        pad_slot: int = 0,
        kv_scales: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Padding rows write to `pad_slot` and attend to nothing (FlexLayout). An unquantized pool only."""
        if kv_scales is not None:
            raise ValueError("the flex backend reads an unquantized K/V pool only (kv_cache_dtype auto)")
        slots: list[int] = []
        for n, past, table in zip(lengths, context_lens, block_tables):
            slots.extend(token_slots(table, block_size, past, past + n))
        slots.extend([pad_slot] * padding)
        device = kv_pool.device
        layout = FlexLayout.build(lengths, context_lens, block_tables, block_size, kv_pool.shape[3], device, padding)
        return cls(slot_mapping=upload(slots, torch.int64, device), kv_pool=kv_pool, timer=timer, flex=layout)

    def attend(self, q: torch.Tensor, pool: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """One flex_attention call over the whole of `pool` (this layer's, new keys and values written)."""
        num_tokens, num_heads, head_dim = q.shape
        layout = self.flex
        options = {"BLOCK_M": FLEX_Q_BLOCK, "BLOCK_N": FLEX_KV_BLOCK} if q.device.type == "cuda" else None
        with warnings.catch_warnings():  # the unfused CPU path warns that it is unfused, at every call
            warnings.simplefilter("ignore", UserWarning)
            out = _flex_function(q.device.type)(
                q.transpose(0, 1)[None], pool[0][None], pool[1][None], block_mask=layout.block_mask(window),
                scale=scale, enable_gqa=num_heads != pool.shape[1], kernel_options=options,
            )  # (1, H, T, D)
        return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

    @classmethod
    def compiles_at_load(cls, device: torch.device) -> bool:
        return device.type == "cuda"

    @classmethod
    def device_warning(cls, device: torch.device) -> str | None:
        if device.type == "cuda":
            return None
        return (f"attention_backend flex on {device} runs PyTorch's unfused flex_attention, which evaluates its "
                "mask over the whole K/V pool at every layer: correct, slow (reference is the fast choice here)")

    @classmethod
    def graph_buffers(cls, kv_pool: torch.Tensor, block_size: int, pad_slot: int, rows: int) -> AttentionMetadata:
        """An all-padding layout of `rows` rows; every size reads its head."""
        device = kv_pool.device
        return cls(
            slot_mapping=torch.full((rows,), pad_slot, dtype=torch.int64, device=device), kv_pool=kv_pool,
            flex=FlexLayout.build([], [], [], block_size, kv_pool.shape[3], device, padding=rows),
        )

    def head(self, num_tokens: int) -> AttentionMetadata:
        return FlexMetadata(slot_mapping=self.slot_mapping[:num_tokens], kv_pool=self.kv_pool,
                            flex=self.flex.head(num_tokens))

    def copy_(self, other: AttentionMetadata) -> None:
        self.slot_mapping.copy_(other.slot_mapping, non_blocking=True)
        self.flex.copy_(other.flex)


@dataclass
class FlexLayout:
    """What the flex backend needs of an iteration, built once and shared by every layer.

    Per token row: its request (`q_request`) and position (`q_position`). Per pool block: the request of
    this iteration that owns it (`block_owner`, -1 for the others) and the position of its first slot in
    that request (`block_start`). A query keeps slot s when block_owner[s // block_size] is its request
    and the slot's position block_start[...] + s % block_size is at most its own (and within its window):
    slots past a request's length, in its partly filled last block, are never kept. Padding rows (after
    the requests' rows) have request -1 and position -1: every slot's position is later, so they keep none
    and come out as zeros (flex's rule for a fully masked row).

    The block-sparse structure: the token rows in tiles of FLEX_Q_BLOCK, the pool's slots in tiles of
    `kv_block`; tile pair (i, j) is visited when a request with a row in query tile i owns a block in slot
    tile j. `kv_num_blocks` (1, 1, Q tiles) and `kv_indices` (1, 1, Q tiles, KV tiles): how many slot tiles
    each query tile visits and which, first."""

    q_request: torch.Tensor  # (T,) int32
    q_position: torch.Tensor  # (T,) int32
    block_owner: torch.Tensor  # (pool blocks,) int32
    block_start: torch.Tensor  # (pool blocks,) int32
    kv_num_blocks: torch.Tensor  # (1, 1, Q tiles) int32
    kv_indices: torch.Tensor  # (1, 1, Q tiles, KV tiles) int32
    block_size: int
    kv_block: int
    num_tokens: int
    num_slots: int
    _masks: dict[int | None, object] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_slots: int,
        device: torch.device,
        padding: int = 0,
    ) -> FlexLayout:
        kv_block = -(-FLEX_KV_BLOCK // block_size) * block_size  # whole K/V blocks per slot tile
        num_tokens = sum(lengths) + padding
        q_request: list[int] = []
        q_position: list[int] = []
        owned: list[int] = []  # pool blocks in use by this iteration's requests, request by request
        owners: list[int] = []
        starts: list[int] = []
        tile_pairs: list[int] = []  # (request, query tile) pairs, flattened request * Q tiles + tile
        num_q_tiles = -(-num_tokens // FLEX_Q_BLOCK)
        row = 0
        for i, (n, past, table) in enumerate(zip(lengths, context_lens, block_tables)):
            q_request.extend([i] * n)
            q_position.extend(range(past, past + n))
            used = -(-(past + n) // block_size)
            owned.extend(table[:used])
            owners.extend([i] * used)
            starts.extend(range(0, used * block_size, block_size))
            first_tile, last_tile = row // FLEX_Q_BLOCK, (row + n - 1) // FLEX_Q_BLOCK
            tile_pairs.extend(i * num_q_tiles + t for t in range(first_tile, last_tile + 1))
            row += n
        q_request.extend([PADDING_ROW] * padding)
        q_position.extend([PADDING_ROW] * padding)
        num_blocks, num_kv_tiles = num_slots // block_size, -(-num_slots // kv_block)
        owned_t, owners_t = upload(owned, torch.int64, device), upload(owners, torch.int64, device)
        block_owner = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        block_owner[owned_t] = owners_t.to(torch.int32)
        block_start = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        block_start[owned_t] = upload(starts, torch.int32, device)
        # Which slot tiles each request reads, which query tiles each request has rows in; their product
        # is which slot tiles each query tile visits.
        num_requests = len(lengths)
        reads = torch.zeros(num_requests, num_kv_tiles, device=device)
        reads[owners_t, owned_t * block_size // kv_block] = 1.0
        rows = torch.zeros(num_requests * num_q_tiles, device=device)
        rows[upload(tile_pairs, torch.int64, device)] = 1.0
        visits = rows.view(num_requests, num_q_tiles).t() @ reads > 0  # (Q tiles, KV tiles)
        kv_num_blocks = visits.sum(-1, dtype=torch.int32)
        kv_indices = torch.argsort(visits.logical_not().to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return cls(
            q_request=upload(q_request, torch.int32, device),
            q_position=upload(q_position, torch.int32, device),
            block_owner=block_owner,
            block_start=block_start,
            kv_num_blocks=kv_num_blocks[None, None],
            kv_indices=kv_indices[None, None],
            block_size=block_size,
            kv_block=kv_block,
            num_tokens=num_tokens,
            num_slots=num_slots,
        )

    def head(self, num_tokens: int) -> FlexLayout:
        """The layout of this one's first `num_tokens` rows, sharing its tensors (views, so what is copied
        into this layout is what the head's masks read): one per CUDA graph size over one set of static
        buffers (orca/worker/cuda_graphs.py)."""
        q_tiles = -(-num_tokens // FLEX_Q_BLOCK)
        kv_tiles = self.kv_indices.shape[-1]
        # The first q_tiles rows of the (1, 1, Q tiles, ...) buffers, viewed with a fresh layout's contiguous
        # strides (a [:, :, :q_tiles] slice keeps the whole buffer's strides, and compiled flex guards on
        # strides: each captured size would compile again, past dynamo's recompile limit, on a GPU run).
        return FlexLayout(
            q_request=self.q_request[:num_tokens], q_position=self.q_position[:num_tokens],
            block_owner=self.block_owner, block_start=self.block_start,
            kv_num_blocks=self.kv_num_blocks.view(-1)[:q_tiles].view(1, 1, q_tiles),
            kv_indices=self.kv_indices.view(-1)[:q_tiles * kv_tiles].view(1, 1, q_tiles, kv_tiles),
            block_size=self.block_size, kv_block=self.kv_block, num_tokens=num_tokens, num_slots=self.num_slots,
        )

    def copy_(self, other: FlexLayout) -> None:
        """Takes `other`'s values (an iteration of the same token count over the same pool) into this
        layout's tensors, in place."""
        if (other.num_tokens, other.num_slots, other.block_size) != (self.num_tokens, self.num_slots, self.block_size):
            raise ValueError(f"a layout of {other.num_tokens} rows over {other.num_slots} slots does not fit one of "
                             f"{self.num_tokens} rows over {self.num_slots} slots")
        for name in ("q_request", "q_position", "block_owner", "block_start", "kv_num_blocks", "kv_indices"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)

    def mask_mod(self, window: int | None) -> Callable:
        """flex_attention's mask function: whether query row q keeps pool slot kv."""
        q_request, q_position, owner, start = self.q_request, self.q_position, self.block_owner, self.block_start
        block_size = self.block_size

        def keep(b, h, q, kv):  # noqa: ANN001, ANN202 - flex's signature (index tensors)
            block = kv // block_size
            position = start[block] + kv % block_size
            kept = (owner[block] == q_request[q]) & (position <= q_position[q])
            if window is not None:
                kept = kept & (q_position[q] - position < window)
            return kept

        return keep

    def block_mask(self, window: int | None = None):  # noqa: ANN201 - a BlockMask (imported lazily)
        """The BlockMask of this iteration (one per window size: the sliding layers' differs)."""
        if window not in self._masks:
            from torch.nn.attention.flex_attention import BlockMask

            self._masks[window] = BlockMask.from_kv_blocks(
                self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=(FLEX_Q_BLOCK, self.kv_block),
                mask_mod=self.mask_mod(window), seq_lengths=(self.num_tokens, self.num_slots),
                compute_q_blocks=False,
            )
        return self._masks[window]


@functools.cache
def _flex_function(device_type: str) -> Callable:
    """flex_attention as it runs on this device: compiled on CUDA (Triton kernels; token counts dynamic, so
    one compilation serves every batch; the worker warms it up at load), PyTorch's unfused implementation
    elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        import torch._dynamo

        # A few shapes specialise (FlexMetadata.warm_up_rows) and each window size and model of the process
        # (an engine per test) adds its own: dynamo's default limit of 8 graphs per function, once reached,
        # silently runs flex unfused (minutes per iteration over a large pool, and no CUDA graph capture).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FLEX_RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               4 * FLEX_RECOMPILE_LIMIT)
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention
