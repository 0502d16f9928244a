"""What the engine runs with: the settings asked for (`EngineConfig`) resolved once against the
model, the devices and the memory into one `Layout`, which the steps, the scheduler and the
start-up log all read. The per-platform choices live here and nowhere else:

    slots              max_slots; auto: 32 on a CPU (the widest decode step that streams the
                       weights once, `cpu_matmul.MAX_COLUMNS`), 8 per data shard when a data axis runs every
                       slot each step, 256 on an accelerator: a slot is a row of state, its
                       sequence's K/V live in the shared pool
    KV page pool       kv_cache_tokens in whole pages; auto: max_seq_len x the slots, at most 8,
                       on a CPU (a modest default that 8 full-length sequences fill; shorter ones
                       share it), memory_fraction of free memory on an accelerator; a pool that
                       cannot fit is refused with one that would
    page size          auto: 64 positions on a CPU (the attention kernel reads pages of 64 as
                       fast as whole rows; 16 cost it ~15%), 16 on an accelerator (JAX's and
                       vLLM's default, not yet measured on one here)
    max_seq_len        capped at the model's context window and at the pool
    prompt pieces      how many a prefill dispatch may carry: the token budget's, bucketed
    decode with prompts whether the decode rows ride in the prompt pieces' dispatch (`mixed_rows`)
    attention kernel   CPU C++ / GPU Pallas / none (XLA's einsums), and so the attention buckets
    packed weights     the CPU matmul kernel where it runs (and, asked for "auto", memory allows)
    quantized weights  kept (and multiplied by their CPU kernel) where it runs, else dequantized
    slot buckets       (a function of the above)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jinfer.config import PROMPT_PIECE, EngineConfig, ModelConfig
from jinfer.kernels import cpu_attention, cpu_matmul, cpu_quant_matmul, gpu_attention


def _geometric_buckets(first: int, factor: int, last: int) -> tuple[int, ...]:
    """first, first * factor, ... while below `last`, then `last`."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= factor
    return (*sizes, last)


# Columns a verify step may give each product: those whose weights stream from memory once (wider,
# the weights' reads are shared enough without drafts).
SPECULATIVE_COLUMNS = cpu_matmul.MAX_COLUMNS

CPU_SLOTS = cpu_matmul.MAX_COLUMNS  # max_slots auto (see the module docstring)
SLOTS_PER_DATA_SHARD = 8
ACCELERATOR_SLOTS = 256
CPU_POOL_SEQUENCES = 8  # kv_cache_tokens auto on a CPU: full-length sequences, at most


def resolve_slots(config: EngineConfig, backend: str) -> int:
    """max_slots, "auto" (None) resolved (see the module docstring)."""
    if config.max_slots is not None:
        return config.max_slots
    if backend != "cpu":
        return ACCELERATOR_SLOTS
    return CPU_SLOTS if config.mesh_data == 1 else SLOTS_PER_DATA_SHARD * config.mesh_data


@dataclasses.dataclass(frozen=True)
class Layout:
    """The engine's layout in effect (see the module docstring for what is resolved)."""

    max_slots: int
    max_seq_len: int
    max_queue: int
    max_num_batched_tokens: int
    decode_steps: int
    speculative: str  # where draft tokens come from (`config.SPECULATIVE`), or "off"
    draft_tokens: int  # tokens a speculative decode step verifies per row (0: speculation off)
    dtype: str
    mesh_data: int
    mesh_model: int
    context_policy: str
    attention_kernel: str | None  # "cpu" / "gpu": the steps attend with that kernel; None: XLA's einsums
    packed_weights: bool  # products of up to cpu_matmul.MAX_COLUMNS columns by the packed kernel
    quantized_weights: bool  # quantized matrices kept, multiplied by the quantized kernel
    page_size: int
    num_pages: int  # pages in each layer's pool, the sink page included
    prefix_caching: bool

    @property
    def max_pages(self) -> int:
        """Block-table entries per sequence: pages of max_seq_len positions."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def verify_variants(self) -> tuple[tuple[int, int], ...]:
        """(slot bucket, draft tokens) pairs compiled as verify steps: draft lengths of powers of
        two up to `draft_tokens` (and it), where rows x (draft tokens + 1) columns stay within
        what one stream of the weights serves (`SPECULATIVE_COLUMNS`); a bigger batch reads the
        weights for enough columns already."""
        if not self.draft_tokens:
            return ()
        lengths = sorted({*(2**i for i in range(self.draft_tokens.bit_length())), self.draft_tokens})
        fits = lambda rows, k: rows * (k + 1) <= SPECULATIVE_COLUMNS
        return tuple((rows, k) for rows in self.slot_buckets for k in lengths if fits(rows, k))

    @property
    def kv_cache_tokens(self) -> int:
        """Positions the pool holds (every page but the sink)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def piece_buckets(self) -> tuple[int, ...]:
        """Prompt pieces (`config.PROMPT_PIECE` tokens each) a prefill dispatch is compiled for:
        powers of two up to what the token budget holds (at least one piece), and no more than
        every slot's whole sequence."""
        most = max(1, self.max_num_batched_tokens // PROMPT_PIECE)
        most = min(most, self.max_slots * -(-self.max_seq_len // PROMPT_PIECE))
        return _geometric_buckets(1, 2, most)

    def piece_bucket(self, pieces: int) -> int:
        return next(b for b in self.piece_buckets if b >= pieces)

    @property
    def mixed_rows(self) -> tuple[int, ...]:
        """The decode rows a prompt pieces' dispatch is compiled to carry as well (empty: decode
        rows always get a dispatch of their own). One forward then reads each weight once for both,
        where the decode dispatch beside it would stream them from memory again (at 32 busy slots
        about as long as a piece takes). Only where a decode row's bits cannot depend on the prompt
        columns beside it: jinfer's CPU kernels for every product (the packed-weight kernel for
        float matrices, the quantized one for quantized blocks: each column one running sum,
        whatever shares the call) and for attention; and no drafts to verify. A mixed dispatch runs
        one decode step of its rows, whatever `decode_steps` a decode dispatch of its own scans
        (the scheduler counts each plan's steps). Two buckets, 8 and every slot: a bucket costs a
        compiled program per piece bucket, and an idle row costs only its columns' products."""
        kernels = self.attention_kernel == "cpu" and self.packed_weights
        if not kernels or self.draft_tokens or self.mesh_data > 1:
            return ()
        return tuple(sorted({min(8, self.max_slots), self.max_slots}))

    def mixed_bucket(self, busy: int) -> int:
        """The decode rows of a mixed dispatch for `busy` = the highest busy slot + 1."""
        return next(b for b in self.mixed_rows if b >= busy)

    @property
    def attention_buckets(self) -> tuple[int, ...]:
        """Decode attends over the first `bucket` cache positions: the smallest that holds every
        slot. A kernel reads each row up to its own length, so with one, one bucket will do (with
        the GPU kernel it bounds only the attention of a prompt chunk carried by a decode step)."""
        if self.attention_kernel:
            return (self.max_seq_len,)
        whole_pages = lambda n: -(-n // self.page_size) * self.page_size
        return tuple(sorted({whole_pages(n) for n in _geometric_buckets(64, 2, self.max_seq_len)}))

    def attention_bucket(self, positions: int) -> int:
        """The smallest attention bucket holding `positions` cache positions (capped at the cache)."""
        return next(b for b in self.attention_buckets if b >= min(positions, self.attention_buckets[-1]))

    @property
    def slot_buckets(self) -> tuple[int, ...]:
        """Decode runs over the first `bucket` slots: the smallest that holds every busy slot.

        1, then powers of two from 4 below max_slots, then max_slots (a single user does not pay
        for four, nor five users for 32; one compiled variant each). With slots split over a data
        axis, always all of them: a prefix of a sharded axis would not be evenly spread over the
        devices.
        """
        if self.mesh_data > 1:
            return (self.max_slots,)
        return (1, *_geometric_buckets(4, 2, self.max_slots)) if self.max_slots > 1 else (1,)

    def slot_bucket(self, busy: int) -> int:
        """The decode rows for `busy` = the highest busy slot + 1."""
        return next(b for b in self.slot_buckets if b >= busy)

    def describe_pool(self, bytes_per_token: int) -> str:
        """One line for the start-up log: the KV page pool and what it holds."""
        full = self.kv_cache_tokens // self.max_seq_len
        caching = "on" if self.prefix_caching else "off"
        return (
            f"KV pool {self.num_pages - 1} pages x {self.page_size} positions = {self.kv_cache_tokens} "
            f"tokens, {self.kv_cache_tokens * bytes_per_token / 2**20:.1f} MiB; {full} sequence"
            f"{'s' * (full != 1)} of max_seq_len={self.max_seq_len} fit at once, {self.max_slots} decode "
            f"at once; prefix caching {caching}"
        )

    def describe(self) -> str:
        """One line for the start-up log: what runs the products and attention, and the buckets."""
        kernels = (
            (self.quantized_weights, "jinfer's quantized kernel (quantized matrices)"),
            (self.packed_weights, "jinfer's packed-weight kernel (float matrices)"),
        )
        products = ", ".join(name for on, name in kernels if on) or "XLA's dot"
        attention = {"cpu": "jinfer's C++ kernel", "gpu": "Pallas kernel", None: "XLA's einsums"}
        steps = f"{self.decode_steps} decode step{'s' * (self.decode_steps != 1)} per dispatch"
        if self.mixed_rows and self.decode_steps != 1:
            steps += f" (1 riding with prompt pieces: {','.join(map(str, self.mixed_rows))} rows)"
        if self.draft_tokens:
            variants = " ".join(f"{rows}x{k}" for rows, k in self.verify_variants) or "none"
            steps += f", speculative ({self.speculative}): up to {self.draft_tokens} draft tokens"
            steps += f" (slots x drafts: {variants})"
        return (
            f"products: {products}; attention: {attention[self.attention_kernel]}; "
            f"{self.max_num_batched_tokens} batched tokens per iteration (prompt pieces "
            f"{','.join(map(str, self.piece_buckets))} x {PROMPT_PIECE}); slot buckets "
            f"{','.join(map(str, self.slot_buckets))}; {steps}"
        )


def attention_kernel(
    config: EngineConfig, models: tuple[ModelConfig, ...], max_pages: int, devices: int
) -> str | None:
    """Which kernel the steps attend with (prompt pieces too; the "gpu" one takes one-token groups
    only), when `config.decode_kernel` asks for one and the mesh is a single device (neither kernel
    has a sharding rule): "gpu": the Pallas paged kernel, for 16-bit
    caches (its float32 products would round to TF32) with block tables it can split; "cpu": the
    C++ kernel, for float32 caches and a head_dim of whole 8-lane vectors (in every model: the
    target, a draft), once it is built. None: XLA's einsums."""
    if not config.decode_kernel or devices != 1:
        return None
    backend = jax.default_backend()
    if backend == "gpu" and config.dtype != "float32" and gpu_attention.fits(max_pages):
        return "gpu"
    if backend == "cpu" and config.dtype == "float32" and all(m.head_dim % 8 == 0 for m in models):
        return "cpu" if cpu_attention.available() else None
    return None


def packed_kernel_runs(config: EngineConfig, devices: int, kernel=cpu_matmul) -> bool:
    """Whether a CPU matmul kernel (the packed one, or `kernel`) can multiply this engine's
    products: one CPU device, float32 (it has no sharding rule and multiplies float32), and the
    kernel built."""
    return (
        devices == 1 and jax.default_backend() == "cpu" and config.dtype == "float32" and kernel.available()
    )


def why_dequantized(config: EngineConfig, devices: int) -> str | None:
    """Why quantized weights would be dequantized at load (None: the quantized kernel multiplies
    them): asked to, or its conditions (as the packed kernel's) do not hold, or it is not built."""
    if config.quantization == "none":
        return "quantization=none"
    if not packed_kernel_runs(config, devices, cpu_quant_matmul):
        return "jinfer multiplies quantized weights on one CPU device, float32, with its kernel built"
    return None


def default_page_size(backend: str) -> int:
    """page_size "auto" (see the module docstring)."""
    return 64 if backend == "cpu" else 16


def _pool_pages(config: EngineConfig, max_seq_len: int, allowed_bytes: float, per_token: int) -> int:
    """Pages the pool is asked to hold, the sink included, a whole number per data shard:
    kv_cache_tokens rounded up to pages, or the per-platform auto value (whole pages that fit
    within `allowed_bytes`, never under one full-length sequence)."""
    page, shards = config.page_size, config.mesh_data
    whole = lambda pages: pages + -(pages + 1) % shards + 1  # + the sink, up to the shards
    if config.kv_cache_tokens is not None:
        return whole(-(-config.kv_cache_tokens // page))
    wanted = -(-min(config.max_slots, CPU_POOL_SEQUENCES) * max_seq_len // page)
    if per_token and jax.default_backend() != "cpu":
        wanted = int(allowed_bytes // (per_token * page))
    if per_token:  # sizes given: never past what fits (less the sink, down to the shards)
        fitting = int(allowed_bytes // (per_token * page)) - 1
        wanted = min(wanted, fitting - (fitting + 1) % shards)
    return whole(max(wanted, -(-max_seq_len // page)))


def _with_sizes_resolved(config: EngineConfig) -> EngineConfig:
    """`config` with page_size and max_slots "auto" resolved for this platform."""
    backend = jax.default_backend()
    page_size = config.page_size or default_page_size(backend)
    return dataclasses.replace(config, page_size=page_size, max_slots=resolve_slots(config, backend))


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _pool_too_large(
    config: EngineConfig, pages: int, per_token: int, allowed: float, max_seq_len: int, packed: bool
) -> ValueError:
    """The error for a pool of `pages` that does not fit in `allowed` bytes: what would fit, and
    what turning the packed weights off (when they run) would free."""
    page = config.page_size
    fit = max(int(allowed // (per_token * page)) - 1, 0) * page
    would = (
        f"kv_cache_tokens={fit} would fit ({fit // max_seq_len} sequences of max_seq_len={max_seq_len})"
        if fit >= max_seq_len
        else f"kv_cache_tokens={fit} with max_seq_len={fit} would fit"
    )
    freed = "; packed_weights=false would free the packed copy of the weights" if packed else ""
    return ValueError(
        f"the KV page pool for kv_cache_tokens={(pages - 1) * page} needs {_size(pages * page * per_token)} "
        f"but only {_size(allowed)} is available ({config.memory_fraction * 100:g}% of free memory"
        f"{', less the packed weights' * packed}); {would}{freed}"
    )


def resolve_layout(
    config: EngineConfig,
    model: ModelConfig,
    devices: int,
    *,
    cache_bytes_per_token: int,
    weight_bytes: int,
    available_bytes: int,
    quantized_weights: bool = False,
    draft: ModelConfig | None = None,
) -> Layout:
    """The layout in effect. `available_bytes`: memory free now, with the weights already loaded;
    the pool and (packed weights) a packed copy of the weights must fit within memory_fraction of
    it. Packed weights "auto" are left off when they would not fit beside the pool. A pool that
    does not fit is refused (ValueError) with the kv_cache_tokens that would. With a `draft` model
    (`jinfer.draft`), cache_bytes_per_token and weight_bytes are both models'."""
    max_seq_len = min(config.max_seq_len, model.max_position_embeddings)
    config = _with_sizes_resolved(config)
    page, per_token = config.page_size, cache_bytes_per_token
    allowed = config.memory_fraction * available_bytes
    pool_bytes = lambda pages: pages * page * per_token
    runs = packed_kernel_runs(config, devices) and config.packed_weights is not False
    if runs and config.packed_weights is None:
        pages = _pool_pages(config, max_seq_len, allowed - weight_bytes, per_token)
        runs = pool_bytes(pages) + weight_bytes <= allowed
    if runs:
        allowed -= weight_bytes
    pages = _pool_pages(config, max_seq_len, allowed, per_token)
    if per_token and pool_bytes(pages) > allowed:
        raise _pool_too_large(config, pages, per_token, allowed, max_seq_len, runs)
    max_seq_len = min(max_seq_len, (pages - 1) * page)
    max_pages = -(-max_seq_len // page)
    return Layout(
        max_slots=config.max_slots,
        max_seq_len=max_seq_len,
        max_queue=config.max_queue,
        max_num_batched_tokens=config.max_num_batched_tokens,
        decode_steps=config.decode_steps,
        speculative=config.speculative,
        draft_tokens=config.num_draft_tokens if config.speculative != "off" else 0,
        dtype=config.dtype,
        mesh_data=config.mesh_data,
        mesh_model=config.mesh_model,
        context_policy=config.context_policy,
        attention_kernel=attention_kernel(config, tuple(m for m in (model, draft) if m), max_pages, devices),
        packed_weights=runs,
        quantized_weights=quantized_weights,
        page_size=page,
        num_pages=pages,
        prefix_caching=config.prefix_caching,
    )


def param_bytes(params) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))


def available_memory_bytes(device) -> int:
    """Free memory of an accelerator, or MemAvailable of the host for CPU devices."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell how much memory is available")
