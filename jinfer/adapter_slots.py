"""The engine's low-rank adapters (`jinfer.lora`): which adapter each slot of its stack holds,
under which name, and what a request's adapter name resolves to.

The stack has `EngineConfig.max_loras` slots of `max_lora_rank` rows over every projection the
model's family lets an adapter change, built with the engine, so that loading an adapter changes
array contents only: nothing compiles, nothing is read from disk when the adapter is a pytree in
memory. `load_adapter(name, adapter)` puts it in a slot no request holds (the name's own slot
when free), then names it; requests that started on the name's previous adapter finish on that
one, so a swap never changes a request's adapter midway. `unload_adapter(name)` forgets the name:
new requests naming it are refused, requests already on it finish on it, and its slot is taken
again once they have. A request's prefix-cache salt names its adapter's slot and how many times
the slot was loaded, so no page one adapter computed is found for another.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

import jinfer.lora as lora
from jinfer.config import ModelConfig
from jinfer.kernels import cpu_matmul
from jinfer.models.family import family_of
from jinfer.models.params import PackedWeight
from jinfer.sampling import RequestError


class NoFreeSlot(ValueError):
    """Every slot holds an adapter that is named or that a request runs on."""


class AdapterSlots:
    """Names and slots of the adapters an engine holds (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, slots: int, rank: int, packed: bool, place: Callable):
        self.cfg, self.rank, self.packed, self.place = cfg, rank, packed, place
        self.targets = tuple(family_of(cfg).adapter_targets(cfg)) if slots else ()
        self.held: list[lora.Adapter | None] = [None] * slots
        self.loads = [0] * slots  # per slot: adapters loaded into it so far
        self.names: dict[str, int] = {}

    def stack(self) -> lora.AdapterStack | None:
        """The held adapters as the steps read them, placed; None without slots."""
        return self.place(self.arranged(self.held)) if self.held else None

    def arranged(self, adapters: list[lora.Adapter | None]) -> lora.AdapterStack:
        """`adapters` (one per slot, None for an empty one) as a stack of this engine's slots,
        rank and targets, packed for jinfer's CPU kernel where the engine packs its weights (jax
        operations only: a traced adapter gives a traced stack)."""
        stack = lora.stack(
            adapters + [None] * (len(self.held) - len(adapters)), self.cfg, self.rank, self.targets
        )
        if not self.packed:
            return stack
        if cpu_matmul.lora_deltas_available():
            fused = lora.fused(stack, self.cfg, cpu_matmul.pack, cpu_matmul.block_rows())
            if fused is not None:
                return fused
        pack = lambda w: PackedWeight(w, cpu_matmul.pack(w))
        layers = [
            {w: lora.WeightPairs(pack(p.a), tuple(map(pack, p.bs))) for w, p in layer.items()}
            for layer in stack.layers
        ]
        return stack.replace(layers=tuple(layers))

    def load(self, name: str, adapter: lora.Adapter, busy: set[int]) -> int:
        """Hold `adapter` under `name` in a slot none of `busy` (slots requests hold) is; its slot."""
        if not self.held:
            raise ValueError("this engine holds no adapters: start it with max_loras > 0")
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        lora.check_adapter(adapter, self.cfg)
        if adapter.config.rank > self.rank:
            raise ValueError(f"the adapter's rank is {adapter.config.rank}; max_lora_rank is {self.rank}")
        named = set(self.names.values())
        current = self.names.get(name)
        free = [s for s in range(len(self.held)) if s not in busy and s not in named]
        slot = current if current is not None and current not in busy else (free[0] if free else None)
        if slot is None:
            raise NoFreeSlot(f"all {len(self.held)} adapter slots (max_loras) hold adapters in use")
        self.held[slot] = jax.tree.map(jax.numpy.asarray, adapter)
        self.loads[slot] += 1
        self.names[name] = slot
        return slot

    def unload(self, name: str) -> None:
        if self.names.pop(name, None) is None:
            raise KeyError(f"no adapter named {name!r} is loaded")

    def resolve(self, name: str | None, salt: str | None) -> tuple[int, str | None]:
        """A request's adapter name -> (its slot, -1 for none; its prefix-cache salt)."""
        if name is None:
            return -1, salt
        slot = self.names.get(name)
        if slot is None:
            loaded = ", ".join(sorted(self.names)) or "none"
            raise RequestError(f"no adapter named {name!r} is loaded (loaded: {loaded})", "adapter")
        return slot, f"{salt or ''}\x00adapter {slot}.{self.loads[slot]}"


def load_adapter(engine, name: str, adapter: lora.Adapter) -> int:
    """Engine method: hold `adapter` under `name` (see the module docstring); its slot."""
    if engine.cluster is not None:
        raise RuntimeError("adapters are not served by a cluster of processes yet")
    with engine._lock:
        busy = {r.adapter for r in engine.scheduler.active_requests() + list(engine.scheduler.waiting)}
        slot = engine.adapters.load(name, adapter, busy)
        engine.device.set_adapters(engine.adapters.stack())
    return slot


def unload_adapter(engine, name: str) -> None:
    """Engine method: forget the adapter `name` (requests on it finish on it)."""
    with engine._lock:
        engine.adapters.unload(name)
