"""Engine assembly: from a loaded model and the settings asked for to the parts an engine runs.

    loaded model + EngineConfig -> mesh -> weights as held (the target's, a draft model's, the
        target's adapter stack: `jinfer.adapter_slots`)
        -> the layout in effect (slots, pages, buckets, kernels: `jinfer.layout`)
        -> compiled programs (`jinfer.steps`) -> the device's values and calls (`jinfer.device`)
        -> the page pool's bookkeeping, the scheduler, request preparation, speculation policy

`assemble` does it once per engine; the engine (`jinfer.engine`) only runs the parts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import jax

from jinfer.adapter_slots import AdapterSlots
from jinfer.config import EngineConfig
from jinfer.device import Device
from jinfer.draft import draft_weights
from jinfer.inputs import RowProcessor
from jinfer.kv_cache import bytes_per_token
from jinfer.layout import Layout, available_memory_bytes, param_bytes, resolve_layout
from jinfer.loading import LoadedModel, engine_weights
from jinfer.models import quantized
from jinfer.models.params import pack_weights
from jinfer.paging import KVPages
from jinfer.prepare import RequestPreparer
from jinfer.processors import registered
from jinfer.scheduler import Scheduler
from jinfer.sharding import DTYPES, make_mesh
from jinfer.speculation import Speculation
from jinfer.steps import Steps, build_steps
from jinfer.weights import Weights

log = logging.getLogger("jinfer.engine")


@dataclasses.dataclass
class EngineParts:
    """What an engine runs with."""

    mesh: jax.sharding.Mesh
    dtype: object
    layout: Layout
    steps: Steps
    device: Device
    kv: KVPages
    scheduler: Scheduler
    preparer: RequestPreparer
    speculation: Speculation | None
    cache_bytes: int  # the KV pool's size
    adapters: AdapterSlots


def assemble(
    loaded: LoadedModel,
    config: EngineConfig,
    processors: Mapping[str, RowProcessor] | Sequence[RowProcessor] = (),
) -> EngineParts:
    """The parts of an engine serving `loaded` as `config` asks (see the module docstring), its
    sampling steps applying `processors` (by name; each checked: `jinfer.processors.registered`)."""
    mesh, dtype = make_mesh(config.mesh_data, config.mesh_model), DTYPES[config.dtype]
    padded_cfg, params = engine_weights(loaded, config, mesh, dtype)
    draft_cfg, draft_params = draft_weights(config, loaded, mesh, dtype)
    models = ((padded_cfg, params), (draft_cfg, draft_params))
    per_token = sum(bytes_per_token(cfg, dtype) for cfg, _ in models if cfg)
    layout = resolve_layout(
        config,
        loaded.config,
        mesh.size,
        cache_bytes_per_token=per_token,
        weight_bytes=sum(param_bytes(quantized.floats(p)) for cfg, p in models if cfg),  # packed copies
        available_bytes=available_memory_bytes(mesh.devices.flat[0]) * mesh.size,
        quantized_weights=bool(quantized.formats_held(params)),
        draft=draft_cfg,
    )
    if layout.packed_weights:  # one device: the packed copies' own placement will do
        params, draft_params = (cfg and pack_weights(p, cfg) for cfg, p in models)
    adapters = _adapter_slots(config, loaded, padded_cfg, layout.packed_weights, mesh, dtype)
    carried = Weights(params, draft_params, adapters.stack())
    shardings = jax.tree.map(lambda a: a.sharding, carried)
    vocab = loaded.config.vocab_size
    processors = registered(processors, vocab=vocab, seq=layout.max_seq_len)
    steps = build_steps(padded_cfg, layout, mesh, shardings, vocab, draft_cfg, processors)
    kv = KVPages(
        layout.num_pages, layout.page_size, layout.max_slots, layout.max_pages, layout.prefix_caching
    )
    held = quantized.describe_held(params)  # slots and sequence length: in the pool's line
    log.info("engine: mesh data=%d model=%d; weights %s", layout.mesh_data, layout.mesh_model, held)
    log.info("engine: %s", layout.describe_pool(per_token))
    log.info("engine: %s", layout.describe())
    return EngineParts(
        mesh=mesh,
        dtype=dtype,
        layout=layout,
        steps=steps,
        device=Device(steps, carried, dtype, kv.tables.copy()),
        kv=kv,
        scheduler=_scheduler(loaded, layout, kv),
        preparer=RequestPreparer(
            loaded.tokenizer,
            vocab_size=loaded.config.vocab_size,
            max_seq_len=layout.max_seq_len,
            eos_token_ids=loaded.eos_token_ids,
            sampling_defaults=loaded.generation_defaults,
            context_policy=layout.context_policy,
            processors=processors,
        ),
        speculation=Speculation(layout, config.speculative_policy) if layout.verify_variants else None,
        cache_bytes=layout.num_pages * layout.page_size * per_token,
        adapters=adapters,
    )


def _adapter_slots(config: EngineConfig, loaded: LoadedModel, padded_cfg, packed: bool, mesh, dtype):
    """The engine's adapter slots; their stack whole on every device, in the engine's dtype."""
    if config.max_loras and padded_cfg != loaded.config:
        raise ValueError("adapters (max_loras) are not served on a model padded for its mesh (mesh_model)")
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    place = lambda tree: jax.device_put(jax.tree.map(lambda a: a.astype(dtype), tree), whole)
    return AdapterSlots(padded_cfg, config.max_loras, config.max_lora_rank, packed, place)


def _scheduler(loaded: LoadedModel, layout: Layout, kv: KVPages) -> Scheduler:
    return Scheduler(
        loaded.tokenizer,
        layout.max_slots,
        layout.max_queue,
        layout.max_num_batched_tokens,
        kv,
        layout.decode_steps,
        layout.draft_tokens,
        piece_buckets=layout.piece_buckets,
        decode_with_prompts=bool(layout.mixed_rows),
    )
