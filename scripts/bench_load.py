"""Peak memory while loading a model onto a mesh of devices: each weight read from the memory-mapped
safetensors slice by slice straight onto its shards (`Placement`, what jinfer does), against the
whole tree loaded onto the first device and placed afterwards (`place_params` alone).

Each way runs in a process of its own (four CPU devices, mesh model 4, the given dtype) and
reports its peak resident memory (VmHWM: on a CPU the devices' buffers are host memory) and the
seconds it took. The model: SmolLM2-135M exported to a float32 Hugging Face directory (the
embedded GGUF's values, via transformers), or --model DIR.

    python scripts/bench_load.py [--model DIR] [--dtype float32|bfloat16] [--out results]

Writes results/bench_load.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchlib import export_hf_from_gguf, markdown_table, progress, write_results

WAYS = {"whole tree, then placed": False, "straight onto the shards": True}


def load_once(model: str, dtype: str, direct: bool) -> dict:
    """In this process: load `model` onto a 1 x 4 mesh one way; peak memory and seconds."""
    import jax

    from jinfer.config import EngineConfig
    from jinfer.loading import load_model, placement_for
    from jinfer.sharding import DTYPES, place_params

    placement = placement_for(EngineConfig(mesh_model=4, dtype=dtype))
    start = time.perf_counter()
    loaded = load_model(model, placement=placement if direct else None)
    _, params = place_params(loaded.config, loaded.params, placement.mesh, DTYPES[dtype])
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(params) for shard in leaf.addressable_shards)
    return {"peak_resident_bytes": peak, "seconds": seconds, "weights_bytes_on_devices": held}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a Hugging Face directory (default: SmolLM2 exported to float32)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="results")
    parser.add_argument("--way", help=argparse.SUPPRESS)  # run one way in this process
    args = parser.parse_args()
    if args.way is not None:
        print(json.dumps(load_once(args.model, args.dtype, args.way == "direct")), flush=True)
        return 0
    model = args.model
    if model is None:
        from jinfer.loading import default_model_path

        model = export_hf_from_gguf(default_model_path(), os.path.join(args.out, "smollm2-f32-hf"))
    env = os.environ | {"JAX_NUM_CPU_DEVICES": "4"}
    figures = {name: [] for name in WAYS}
    for round_index in range(args.rounds):  # alternating, each way in a fresh process
        for name, direct in WAYS.items():
            way = "direct" if direct else "whole"
            cmd = [sys.executable, __file__, "--model", model, "--dtype", args.dtype, "--way", way]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            figures[name].append(json.loads(out.strip().splitlines()[-1]))
            progress(f"round {round_index + 1}, {name}: {figures[name][-1]}")
    rows = [
        {
            "way": name,
            "peak_resident_mib": min(f["peak_resident_bytes"] for f in runs) / 2**20,
            "seconds": min(f["seconds"] for f in runs),
            "weights_mib_on_devices": runs[0]["weights_bytes_on_devices"] / 2**20,
        }
        for name, runs in figures.items()
    ]
    table = markdown_table(
        ["way", "peak resident MiB", "seconds", "weights MiB on the devices"],
        [[r["way"], r["peak_resident_mib"], r["seconds"], r["weights_mib_on_devices"]] for r in rows],
    )
    header = f"Loading {model} onto 4 CPU devices (mesh model 4, {args.dtype}), best of {args.rounds}\n\n"
    write_results(args.out, "bench_load", {"model": model, "dtype": args.dtype, "rows": rows}, header + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
