"""What the engine runs with: the settings asked for (`EngineConfig`) resolved once against the
model, the devices and the memory into one `Layout`, which the steps, the scheduler and the
start-up log all read. The per-platform choices live here and nowhere else:

    max_seq_len        capped at the model's context window
    prefill_buckets    none longer than max_seq_len
    attention kernel   CPU C++ / GPU Pallas / none (XLA's einsums), and so the attention buckets
    packed weights     the CPU matmul kernel where it runs (and, asked for "auto", memory allows)
    slot buckets, mixed chunk sizes  (functions of the above)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jinfer.config import COLUMN_TILE, EngineConfig, ModelConfig
from jinfer.kernels import cpu_attention, cpu_matmul, gpu_attention


def _geometric_buckets(first: int, factor: int, last: int) -> tuple[int, ...]:
    """first, first * factor, ... while below `last`, then `last`."""
    sizes, size = [], first
    while size < last:
        sizes.append(size)
        size *= factor
    return (*sizes, last)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The engine's layout in effect (see the module docstring for what is resolved)."""

    max_slots: int
    max_seq_len: int
    max_queue: int
    prefill_buckets: tuple[int, ...]
    prefill_token_budget: int
    decode_steps: int
    mixed_prefill_tokens: int
    dtype: str
    mesh_data: int
    mesh_model: int
    context_policy: str
    attention_kernel: str | None  # "cpu" / "gpu": decode attends with that kernel; None: XLA's einsums
    packed_weights: bool  # products of up to cpu_matmul.MAX_COLUMNS columns by the packed kernel

    @property
    def chunk_len(self) -> int:
        """Prompts longer than the largest bucket are prefilled in chunks of this many tokens."""
        return self.prefill_buckets[-1]

    @property
    def attention_buckets(self) -> tuple[int, ...]:
        """Decode attends over the first `bucket` cache positions: the smallest that holds every
        slot. A kernel reads each row up to its own length, so with one, one bucket will do (with
        the GPU kernel it bounds only the attention of a prompt chunk carried by a decode step)."""
        if self.attention_kernel:
            return (self.max_seq_len,)
        return _geometric_buckets(64, 2, self.max_seq_len)

    def attention_bucket(self, positions: int) -> int:
        """The smallest attention bucket holding `positions` cache positions (capped at the cache)."""
        return next(b for b in self.attention_buckets if b >= min(positions, self.max_seq_len))

    @property
    def slot_buckets(self) -> tuple[int, ...]:
        """Decode runs over the first `bucket` slots: the smallest that holds every busy slot.

        Powers of four below max_slots, then max_slots (few compiled variants, and a single user
        does not pay for eight). With slots split over a data axis, always all of them: a prefix
        of a sharded axis would not be evenly spread over the devices.
        """
        if self.mesh_data > 1:
            return (self.max_slots,)
        return _geometric_buckets(1, 4, self.max_slots)

    def slot_bucket(self, busy: int) -> int:
        """The decode rows for `busy` = the highest busy slot + 1."""
        return next(b for b in self.slot_buckets if b >= busy)

    def mixed_chunk_len(self, busy: int) -> int:
        """Prompt tokens carried by a decode dispatch for `busy` = the highest busy slot + 1 (0 when
        mixing is off); the dispatch decodes rows = slot_bucket(busy).

        At least `mixed_prefill_tokens`, more where the step's extra columns come free. XLA's
        products cost whole COLUMN_TILEs, so rows + chunk are rounded up to fill them (a 1-slot step
        carries 7 tokens for the price of 5). With packed weights the kernel's first 8 columns wait
        on the weights' bytes, each column past them on its multiplies, so the chunk only fills
        the first tile (8 slots: 4 tokens, 12 columns, where 16 cost 1.5x a plain step).
        """
        if not self.mixed_prefill_tokens:
            return 0
        rows = self.slot_bucket(busy)
        if self.packed_weights:
            return max(self.mixed_prefill_tokens, COLUMN_TILE - rows)
        return -(-(rows + self.mixed_prefill_tokens) // COLUMN_TILE) * COLUMN_TILE - rows

    def describe(self) -> str:
        """One line for the start-up log: what runs the products and attention, and the buckets."""
        products = "jinfer's packed-weight kernel (CPU)" if self.packed_weights else "XLA's dot"
        attention = {"cpu": "jinfer's C++ kernel", "gpu": "Pallas kernel", None: "XLA's einsums"}
        mixed = f", mixed prefill {self.mixed_prefill_tokens}+ tokens" if self.mixed_prefill_tokens else ""
        steps = f"{self.decode_steps} decode step{'s' * (self.decode_steps != 1)} per dispatch"
        return (
            f"products: {products}; attention: {attention[self.attention_kernel]}; "
            f"prefill buckets {','.join(map(str, self.prefill_buckets))}; slot buckets "
            f"{','.join(map(str, self.slot_buckets))}; {steps}{mixed}"
        )


def attention_kernel(config: EngineConfig, model: ModelConfig, max_seq_len: int, devices: int) -> str | None:
    """Which kernel decode attends with, when `config.decode_kernel` asks for one and the mesh is a
    single device (neither kernel has a sharding rule): "gpu": the Pallas kernel, for 16-bit caches
    (its float32 products would round to TF32) of a length it can split; "cpu": the C++ kernel, for
    float32 caches and a head_dim of whole 8-lane vectors, once it is built. None: XLA's einsums."""
    if not config.decode_kernel or devices != 1:
        return None
    backend = jax.default_backend()
    if backend == "gpu" and config.dtype != "float32" and gpu_attention.fits(max_seq_len):
        return "gpu"
    if backend == "cpu" and config.dtype == "float32" and model.head_dim % 8 == 0:
        return "cpu" if cpu_attention.available() else None
    return None


def packed_kernel_runs(config: EngineConfig, devices: int) -> bool:
    """Whether the CPU matmul kernel can multiply this engine's products: one CPU device, float32
    (it has no sharding rule and multiplies float32), and the kernel built."""
    return (
        devices == 1
        and jax.default_backend() == "cpu"
        and config.dtype == "float32"
        and cpu_matmul.available()
    )


def resolve_layout(
    config: EngineConfig,
    model: ModelConfig,
    devices: int,
    *,
    cache_bytes_per_token: int,
    weight_bytes: int,
    available_bytes: int,
) -> Layout:
    """The layout in effect. `available_bytes`: memory free now, with the weights already loaded;
    packed weights "auto" needs room for their copy beside the KV cache within memory_fraction."""
    max_seq_len = min(config.max_seq_len, model.max_position_embeddings)
    packed = config.packed_weights
    if packed is None or packed:
        runs = packed_kernel_runs(config, devices)
        cache = cache_bytes_per_token * config.max_slots * max_seq_len
        fits = cache + weight_bytes <= config.memory_fraction * available_bytes
        packed = runs and (fits or config.packed_weights is True)
    return Layout(
        max_slots=config.max_slots,
        max_seq_len=max_seq_len,
        max_queue=config.max_queue,
        prefill_buckets=tuple(sorted({min(b, max_seq_len) for b in config.prefill_buckets})),
        prefill_token_budget=config.prefill_token_budget,
        decode_steps=config.decode_steps,
        mixed_prefill_tokens=config.mixed_prefill_tokens,
        dtype=config.dtype,
        mesh_data=config.mesh_data,
        mesh_model=config.mesh_model,
        context_policy=config.context_policy,
        attention_kernel=attention_kernel(config, model, max_seq_len, devices),
        packed_weights=bool(packed),
    )


def param_bytes(params) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))
