"""Lookback attention inside vLLM: the weights RAUQ, TAD and the full preset read, from the
query of each planned row and vLLM's paged key cache.

The transformers capture keeps, at each generated token's step t, the attention weight of
every head of every layer to the K previous generated tokens (`actmap.capture.lookback`):

    z_j = scale * q . k_j               for every key j <= p (prompt included), p = the row's
    w_k = exp(z_{p+1-k} - logsumexp z)  position; k = 1..min(K, t), 0 for k > t

Here the same numbers come from inside vLLM's attention path. Every vLLM ``Attention`` module
of a decoder layer gets a forward hook (put in while the model loads, before vLLM compiles it,
beside `actmap.capture.vllm_engine`'s record points). In a compiled model the hook is one call
of the opaque custom op ``actmap::record_attention`` on the module's post-RoPE query and its
output (the output orders the op after vLLM's attention; under piecewise CUDA graphs the op is
a splitting op, like ``record_layer``); in an eager model it calls the op's body directly.
Either way, right after vLLM's attention of that layer wrote and read its keys, it takes the
query of each row the recorder planned (generated tokens of requests that keep attention),
reads the keys of positions ``0..p`` of each row through its block table, takes one
``(H, p+1)`` float32 logit vector per row, and writes the K weights into a step buffer
``(rows, L, H, K)`` that leaves the device with the step's other rows (`AttentionTap.finish`).
A float32 cache in the transposed layout is read in place, one ``embedding_bag`` summing each
key dimension's row weighted by the query's component (`bag_logits`); the others are gathered
first (`gathered_logits`). Only the planned rows are computed (nothing of size queries x keys),
and vLLM's own attention output is untouched.

What it reads must be how vLLM stored the keys: the CPU backend (``CPU_ATTN``) stores each
block's keys of one head transposed, ``(head_size, block)``, for its ``vec``/``vec16`` kernels,
and in tiles of 16 positions with the head size in pairs, ``(block / 16, head_size / 2, 16,
2)``, for ``amx`` (bfloat16); tested against vLLM's cache writer. Other backends (the GPU
ones), fp8 key caches, sliding windows, soft-capped logits, ALiBi, attention sinks, layers
with different scales and tensor parallel (each rank holds some heads) are refused by name, as
are model families whose attention this has not been tested against
(`VLLM_ATTENTION_FAMILIES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

ATTENTION_OP = "actmap::record_attention"
# model_type of the families whose lookback weights from vLLM equal the transformers
# capture's (tests/test_capture_vllm_attention.py)
VLLM_ATTENTION_FAMILIES = frozenset({"llama", "qwen2"})
# CPU_ATTN's key layout per kernel ISA, (tile, per): a block's keys of one head as
# (block / tile, head_size / per, tile, per); tile None: the whole block
_CPU_KEY_PACKING = {"vec": (None, 1), "vec16": (None, 1), "amx": (16, 2)}
# the layers' logits a step holds before weighing them stay within this many bytes
LOGITS_BUDGET = 32 << 20
# the most positions one row of an in-place read covers (`bag_width`)
BAG_WIDTH = 64

# the tap reading this process's engine (one per process, as `vllm_engine._ACTIVE`)
_TAPS: list[AttentionTap] = []


@torch.library.custom_op(ATTENTION_OP, mutates_args=("sink",))
def record_attention(
    query: torch.Tensor, output: torch.Tensor, sink: torch.Tensor, layer: int
) -> None:
    """One attention layer's query, after vLLM's attention wrote its keys -> the tap (a
    no-op while no tap has planned rows). ``output`` is read by nobody: it orders the call
    after the attention; ``sink`` keeps it in a compiled graph."""
    if _TAPS and _TAPS[0].planned:
        _TAPS[0].record(layer, query)


@record_attention.register_fake
def _record_attention_fake(query, output, sink, layer) -> None:
    return None


def attention_modules(layers: nn.ModuleList) -> list[nn.Module]:
    """Each decoder layer's vLLM ``Attention`` module (exactly one per layer)."""
    from vllm.model_executor.layers.attention import Attention

    found = []
    for index, layer in enumerate(layers):
        inside = [m for m in layer.modules() if isinstance(m, Attention)]
        if len(inside) != 1:
            raise RuntimeError(f"decoder layer {index} holds {len(inside)} vLLM Attention modules")
        found.append(inside[0])
    return found


def add_attention_points(model: nn.Module, layers: nn.ModuleList) -> None:
    """A forward hook on every decoder layer's ``Attention`` calling `record_attention`
    (``model._actmap_attention``: the modules, by layer). A model whose layers do not hold
    one attention module each gets none (its attention cannot be read)."""
    try:
        modules = attention_modules(layers)
    except RuntimeError:
        model._actmap_attention = None
        return
    for index, (layer, module) in enumerate(zip(layers, modules, strict=True)):
        device = next(layer.parameters()).device
        module.register_buffer("_actmap_attention_sink", torch.zeros(1, device=device),
                               persistent=False)  # fmt: skip
        module.register_forward_hook(_attention_hook(index), with_kwargs=True)
    model._actmap_attention = modules


def _attention_hook(index: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        query = args[0] if args else kwargs.get("query")
        if query is None:
            return
        if torch.compiler.is_compiling():  # traced: the op call stays in the compiled graph
            sink = module._actmap_attention_sink
            torch.ops.actmap.record_attention(query, output, sink, index)
        elif _TAPS and _TAPS[0].planned:  # eager: the op's body without its dispatch
            _TAPS[0].record(index, query)

    return hook


def attention_problem(model: nn.Module, model_config, parallel_config=None) -> str | None:
    """Why lookback attention cannot be read from this vLLM model (None: it can)."""
    family = getattr(model_config.hf_text_config, "model_type", None)
    if family not in VLLM_ATTENTION_FAMILIES:
        return (
            f"lookback attention inside vLLM is built for {', '.join(sorted(VLLM_ATTENTION_FAMILIES))}"
            f" models, not {family!r}: capture this model's attention with --engine local"
        )
    if parallel_config is not None and parallel_config.tensor_parallel_size > 1:
        return "lookback attention inside vLLM needs tensor_parallel_size=1 (each rank holds some heads)"
    modules = getattr(model, "_actmap_attention", None)
    if not modules:
        return "vLLM loaded this model without actmap's attention points"
    for module in modules:
        impl = module.impl
        backend = module.attn_backend.get_name()
        isa = getattr(module, "isa", None)
        if backend != "CPU_ATTN" or isa not in _CPU_KEY_PACKING:
            return (
                f"lookback attention inside vLLM reads the CPU backend's key cache "
                f"(CPU_ATTN with {'/'.join(_CPU_KEY_PACKING)} kernels), not {backend}"
                + (f" ({isa})" if isa else "")
            )
        if float(impl.scale) != float(modules[0].impl.scale):
            return "lookback attention inside vLLM needs the same attention scale in every layer"
        if str(impl.kv_cache_dtype) != "auto":
            return f"lookback attention inside vLLM needs an unquantized key cache, not {impl.kv_cache_dtype}"
        unsupported = {
            "a sliding window": impl.sliding_window not in (None, -1),
            "soft-capped logits": bool(impl.logits_soft_cap),
            "ALiBi": impl.alibi_slopes is not None,
            "attention sinks": getattr(impl, "sinks", None) is not None,
        }
        for what, present in unsupported.items():
            if present:
                return f"lookback attention inside vLLM does not handle {what}"
    return None


@dataclass
class AttentionRows:
    """One step's attention rows, copied to the host (or on their way there)."""

    host: torch.Tensor  # (m, L, H, K) float32
    picks: np.ndarray  # (m,) which of the step's selected tokens each row belongs to


class AttentionTap:
    """The lookback weights of the planned rows: right after vLLM's attention of layer i has
    read its keys (they are still in the CPU's caches, and stay in vLLM's paged cache until
    the next step), that layer's op computes its rows' logits; the layers' logits are then
    normalised together into the step buffer ``(rows, L, H, K)`` (at `finish`, or earlier
    when they reach `LOGITS_BUDGET` bytes), and `finish` hands the buffer on."""

    def __init__(self, model: nn.Module, capacity: int) -> None:
        self.modules = model._actmap_attention
        first = self.modules[0]
        self.n_layers = len(self.modules)
        self.heads, self.kv_heads = int(first.num_heads), int(first.num_kv_heads)
        self.head_size = int(first.head_size)
        self.device = first.kv_cache.device
        self.packing = [_CPU_KEY_PACKING[m.isa] for m in self.modules]
        # every layer's keys read in place (`bag_logits`), else gathered
        self.bag = all(
            bag_readable(m.kv_cache, p) and m.kv_cache.shape == first.kv_cache.shape
            for m, p in zip(self.modules, self.packing, strict=True)
        )
        self.scale = float(first.impl.scale)  # the same in every layer (`attention_problem`)
        self.keys = 1  # K of the buffer: the most any request asked for so far
        self.buffer = torch.zeros(capacity, self.n_layers, self.heads, 1, device=self.device)
        self.planned = False
        self._picks: np.ndarray | None = None
        self._select = self._batch = self._position = self._take = None
        self._tables: torch.Tensor | None = None  # (m, blocks) this step's rows' cache blocks
        self._bag: tuple[torch.Tensor, ...] | None = None  # this step's `bag_index`
        self._logits: list[tuple[int, torch.Tensor]] = []  # layers read, not yet weighed
        self._blocks = 0  # key blocks the furthest row reads
        self._keep = 0  # positions the furthest row reads
        self._fired = 0

    # -- the recorder's side -----------------------------------------------------------------
    def plan(
        self,
        flat: list[int],
        rows: list[int],
        batch_rows: list[int],
        owners: list,
    ) -> None:
        """Which of this step's selected tokens get weights: generated tokens (row >= 1) of
        requests whose config keeps attention; ``batch_rows``: each token's request index in
        vLLM's batch (its block table row)."""
        picks = [
            k for k, (row, owner) in enumerate(zip(rows, owners, strict=True))
            if row >= 1 and owner.config.attention_keys > 0
        ]  # fmt: skip
        self.planned = bool(picks)
        self._tables, self._bag, self._fired, self._logits = None, None, 0, []
        if not picks:
            return
        keys = max(owners[k].config.attention_keys for k in picks)
        if keys > self.keys or len(picks) > self.buffer.shape[0]:
            self.keys = max(keys, self.keys)
            size = max(len(picks), self.buffer.shape[0])
            self.buffer = torch.zeros(
                size, self.n_layers, self.heads, self.keys, device=self.device
            )
        positions = [rows[k] + owners[k].prompt_tokens - 1 for k in picks]
        takes = [min(rows[k], owners[k].config.attention_keys) for k in picks]
        block = int(self.modules[0].kv_cache.shape[2])
        self._blocks = max(positions) // block + 1
        self._keep = max(positions) + 1  # the positions the furthest row reads
        device = self.device

        def put(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        self._picks = np.asarray(picks)
        self._select = put([flat[k] for k in picks])
        self._batch = put([batch_rows[k] for k in picks])
        self._position = put(positions)
        self._take = put(takes)

    def finish(self) -> AttentionRows | None:
        """Every layer's weights of the planned rows, on their way to the host (None: none
        were planned). Called after the forward."""
        if not self.planned:
            return None
        self.planned = False
        if self._fired != self.n_layers:
            raise RuntimeError(
                f"lookback attention recorded {self._fired} of {self.n_layers} layers: its "
                "op did not run at every attention layer"
            )
        self._weigh()
        m = len(self._picks)
        if self.device.type == "cuda":
            host = torch.empty(self.buffer[:m].shape, pin_memory=True)
            host.copy_(self.buffer[:m], non_blocking=True)  # the step's event follows
        else:
            host = self.buffer[:m].clone()
        return AttentionRows(host, self._picks)

    # -- inside the forward ------------------------------------------------------------------
    def record(self, index: int, query: torch.Tensor) -> None:
        """Layer ``index``'s logits of the planned rows, from its query (and, at the step's
        first layer, the rows' block tables), after vLLM's attention wrote its keys."""
        module = self.modules[index]
        if self._tables is None:
            from vllm.model_executor.layers.attention.attention import get_attention_context

            metadata = get_attention_context(module.layer_name)[0]
            table = metadata.block_table.index_select(0, self._batch)
            self._tables = table[:, : self._blocks].long()
            if self.bag:
                self._bag = bag_index(self._tables, module.kv_cache.shape, self.heads,
                                      self._keep, self._position, self._select)  # fmt: skip
        m = len(self._picks)
        if self._bag is not None:  # read in place: positions 0..keep-1 of the rows' blocks
            logits = bag_logits(query, module.kv_cache, *self._bag, self.scale,
                                (m, self.heads))  # fmt: skip
        else:  # gathered: whole blocks, or a one-block row's used part
            rows = query.view(-1, self.heads, self.head_size).index_select(0, self._select)
            keep = self._keep if self._blocks == 1 else None
            logits = gathered_logits(rows, module.kv_cache, self._tables, self.packing[index],
                                     self.scale, keep)  # fmt: skip
        self._logits.append((index, logits))
        self._fired += 1
        if len(self._logits) * logits.numel() * 4 >= LOGITS_BUDGET:
            self._weigh()

    def _weigh(self) -> None:
        """The held layers' logits -> their weights in the step buffer (one batched
        normalisation: per layer, its handful of small operations cost more than the
        logits)."""
        if not self._logits:
            return
        layers = [index for index, _ in self._logits]
        # (layers, m, H, keep): no row reads past the furthest row's position
        logits = torch.stack([logits[..., : self._keep] for _, logits in self._logits])
        self._logits = []
        weights = lookback_from_logits(logits, self._position, self._take, self.keys)
        if layers != list(range(layers[0], layers[-1] + 1)):
            raise RuntimeError(f"lookback attention recorded layers {layers} out of order")
        self.buffer[: len(self._picks), layers[0] : layers[-1] + 1, :, : self.keys] = (
            weights.transpose(0, 1)
        )


def key_blocks(kv_cache: torch.Tensor, packing: tuple[int | None, int]) -> torch.Tensor:
    """The CPU backend's key cache as a view ``(blocks, KV, block / tile, head_size / per,
    tile, per)`` (``packing`` = (tile, per), `_CPU_KEY_PACKING`): position ``j`` of a block
    is tile ``j // tile``, entry ``j % tile``.

    ``kv_cache`` is ``(blocks, KV, block, 2 * head_size)``; each (block, head) holds its keys
    in the first ``block * head_size`` elements, then its values."""
    n_blocks, kv_heads, block, twice = kv_cache.shape
    tile, per = packing
    tile = tile or block
    keys = kv_cache.flatten(-2).unflatten(-1, (2, block * (twice // 2))).select(-2, 0)  # a view
    return keys.unflatten(-1, (block // tile, twice // 2 // per, tile, per))


def gather_key_blocks(
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    packing: tuple[int | None, int],
    keep: int | None = None,
) -> torch.Tensor:
    """``key_blocks(kv_cache, packing)[tables]``, (m, n, KV, tiles, d / per, tile, per): each
    (block, head)'s keys are one contiguous run, copied whole (`index_select` on rows: about
    2.5x faster here than indexing the 6-d view).

    ``keep``: when every row reads one block (``n == 1``), only its first ``keep`` positions
    are copied (rounded up to whole tiles; ``tile`` is then ``keep`` for the transposed
    layouts): a short context's rows read a fraction of a 128-position CPU block."""
    n_blocks, kv_heads, block, twice = kv_cache.shape
    if not kv_cache.is_contiguous():
        return key_blocks(kv_cache, packing)[tables]
    dim, (tile, _) = twice // 2, packing
    runs = kv_cache.view(n_blocks * kv_heads, 2, block * dim).select(1, 0)
    heads = torch.arange(kv_heads, device=tables.device)
    index = (tables[..., None] * kv_heads + heads).flatten()
    layout = key_blocks(kv_cache[:1], packing).shape[2:]  # (tiles, d / per, tile, per)
    if keep is None or tables.shape[1] != 1 or keep >= block:
        return runs.index_select(0, index).view(*tables.shape, kv_heads, *layout)
    if tile is None:  # a run is (d, block): its first `keep` columns
        picked = runs.view(-1, dim, block)[:, :, :keep].index_select(0, index)
        return picked.view(*tables.shape, kv_heads, 1, dim, keep, 1)
    tiles = -(-keep // tile)  # a run is whole tiles of `tile` positions: a prefix of them
    picked = runs[:, : tiles * (block // layout[0]) * dim].index_select(0, index)
    return picked.view(*tables.shape, kv_heads, tiles, *layout[1:])


def bag_readable(kv_cache: torch.Tensor, packing: tuple[int | None, int]) -> bool:
    """Whether `bag_logits` reads this cache: float32, contiguous, each (block, head)'s keys
    stored transposed, ``(head_size, block)`` (the ``vec``/``vec16`` kernels' layout)."""
    return packing == (None, 1) and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()


def bag_width(block: int) -> int:
    """The positions one `bag_logits` row covers: a key dimension's values at ``w``
    consecutive positions of one block (the largest width dividing both the block and
    `BAG_WIDTH`: 64 for the CPU's 128-position blocks)."""
    return math.gcd(block, BAG_WIDTH)


def bag_index(
    tables: torch.Tensor,
    shape: torch.Size,
    heads: int,
    keep: int | None = None,
    positions: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `bag_logits` reads for rows with these cache blocks (``tables`` (m, n)) of a
    cache of ``shape`` (blocks, KV, block, 2 * d): one bag per row, query head and span chunk
    of `bag_width` positions; in it, for each key dimension, the row of
    ``kv_cache.view(-1, w)`` holding that dimension at those positions (``index``), and which
    element of the query (`torch.take`'s order) weighs it (``picks``); ``offsets``: where
    each bag starts. The chunks cover positions ``0..keep-1`` (None: the ``n`` blocks), so a
    short context reads only the first chunks of its block; with ``positions`` (m,), a row's
    bags past the chunk holding its own position are empty (their logits 0: positions a
    row's lookback never reads). ``tokens`` (m,): each row's token in a query of the whole
    step, ``(tokens, H, d)`` (None: the query is the rows', ``(m, H, d)``)."""
    _, kv_heads, block, twice = shape
    dim, width = twice // 2, bag_width(block)
    per = block // width  # chunks a block holds
    span = tables.shape[1] * block if keep is None else min(keep, tables.shape[1] * block)
    device = tables.device
    chunk = torch.arange(-(-span // width), device=device)  # (chunks,)
    blocks = tables[:, chunk // per]  # (m, chunks): the block each chunk lies in
    key_head = torch.arange(heads, device=device) // (heads // kv_heads)
    # row of (block b, key head k, dimension c, chunk j) = ((b * KV + k) * 2d + c) * per + j
    start = (blocks[:, None, :] * kv_heads + key_head[None, :, None]) * twice  # (m, H, chunks)
    dims = torch.arange(dim, device=device)
    index = (start[..., None] + dims) * per + (chunk % per)[None, None, :, None]
    m = tables.shape[0]
    if tokens is None:
        tokens = torch.arange(m, device=device)
    head = tokens[:, None] * heads + torch.arange(heads, device=device)  # (m, H)
    picks = (head[..., None] * dim + dims).view(m, heads, 1, dim)
    picks = picks.expand(m, heads, len(chunk), dim)  # (m, H, chunks, d)
    if positions is None:
        offsets = torch.arange(0, index.numel(), dim, device=device)
        return index.flatten(), offsets, picks.flatten()
    used = chunk[None, :] <= (positions // width)[:, None]  # (m, chunks)
    used = used[:, None, :].expand(m, heads, len(chunk))  # (m, H, chunks)
    sizes = used.flatten().long() * dim
    offsets = torch.cumsum(sizes, 0) - sizes
    return index[used].flatten(), offsets, picks[used].flatten()


def bag_logits(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    index: torch.Tensor,
    offsets: torch.Tensor,
    picks: torch.Tensor,
    scale: float,
    shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(m, H, chunks * w) logits read in place from the cache (`bag_index`): each bag of
    ``torch.nn.functional.embedding_bag`` sums the ``d`` key-dimension rows its index names,
    each weighted by the query's component (``scale * q_c``), so the keys are read once and
    never copied (a gather first copies them, then reads them again). ``picks`` are elements
    of ``query`` in `torch.take`'s order; ``shape``: (m, H) (None: ``query``'s (m, H, d))."""
    m, heads = shape or query.shape[:2]
    width = bag_width(kv_cache.shape[2])
    weights = torch.take(query, picks).float().mul_(scale)
    logits = torch.nn.functional.embedding_bag(
        index, kv_cache.view(-1, width), offsets, mode="sum", per_sample_weights=weights
    )  # (m * H * chunks, w)
    return logits.view(m, heads, -1)


def gathered_logits(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    packing: tuple[int | None, int],
    scale: float,
    keep: int | None = None,
) -> torch.Tensor:
    """(m, H, span) float32 logits ``scale * q . k`` of each row's query (``query``
    (m, H, d)) to the keys of its ``n`` cache blocks (``tables`` (m, n)), from a copy of them
    (`gather_key_blocks`: any layout and dtype); span is ``n * block``, or about ``keep`` with
    one block per row; query head h reads key head h // G, vLLM's grouping; positions past a
    row's own are not masked here. (`bag_logits` reads a float32 transposed cache in place.)"""
    m, heads, dim = query.shape
    kv_heads = kv_cache.shape[1]
    groups = heads // kv_heads
    # (m, n, KV, tiles, d / per, tile, per)
    blocks = gather_key_blocks(kv_cache, tables, packing, keep)
    scaled = query.float() * scale  # (q * scale) . k: m x H x d multiplications, not m x H x S
    if packing[1] == 1:  # (d, tile) matrices as stored: one batched product, no copy
        q = scaled.view(m, 1, kv_heads, 1, groups, dim)
        logits = torch.matmul(q, blocks.float().squeeze(-1))  # (m, n, KV, tiles, G, tile)
        logits = logits.permute(0, 2, 4, 1, 3, 5)
    else:
        q = scaled.view(m, kv_heads, groups, dim // packing[1], packing[1])
        logits = torch.einsum("rkgpc,rnkjpsc->rkgnjs", q, blocks.float())
    return logits.reshape(m, heads, -1)


def lookback_from_logits(
    logits: torch.Tensor, positions: torch.Tensor, takes: torch.Tensor, keys: int
) -> torch.Tensor:
    """(..., m, H, keys) weights ``exp(z_{p+1-k} - logsumexp_{j <= p} z_j)`` for k = 1..keys,
    0 where k > take, from logits (..., m, H, span) (row r's keys are its positions
    0..positions[r]; leading dims, such as layers, are batched). A contiguous ``logits`` is
    overwritten past each row's position."""
    m, heads, width = logits.shape[-3:]
    logits = logits.contiguous()
    span = torch.arange(width, device=logits.device)
    beyond = (span[None, :] > positions[:, None])[:, None, :].expand(m, heads, width)
    # one (m * H * span) mask over the leading dims: a contiguous inner loop, unlike the same
    # mask broadcast over H
    logits.view(-1, m * heads * width).masked_fill_(beyond.reshape(1, -1), float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    back = torch.arange(keys, device=logits.device)
    where = (positions[:, None] - back[None, :]).clamp(min=0)  # (m, keys): k = 1 is p itself
    picked = weights.gather(-1, where[:, None, :].expand(*weights.shape[:-1], keys))
    return picked.masked_fill_((back[None, :] >= takes[:, None])[:, None, :], 0.0)
