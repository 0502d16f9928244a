"""Decode speed by door: `jinfer.LLM()` as a library user gets it against the engine `jinfer serve`
builds (the same defaults, with the server's SERVING_DEFAULTS: one decode step per dispatch, a
smaller token budget), both on the embedded model. Prints which products and attention each runs,
then for each slot count the compiled decode's time per step in alternating rounds, and the median of the
paired ratios; the two should be within noise (they multiply with the same kernels).

    python scripts/bench_doors.py [--slots 1,8] [--rounds 7] [--out results]

Writes results/bench_doors.{json,md}.
"""

from __future__ import annotations

import argparse

import numpy as np
from benchlib import alternate_decode_timings, markdown_table, paired_ratio, progress, write_results

import jinfer
from jinfer_serve.main import SERVING_DEFAULTS


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", default="1,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    rows = []
    for slots in [int(s) for s in args.slots.split(",")]:
        progress(f"{slots} slots: LLM() and the server's engine (load, build, warm up)")
        engines = {
            "LLM()": jinfer.LLM(max_slots=slots).engine,
            "jinfer serve": jinfer.LLM(max_slots=slots, **SERVING_DEFAULTS).engine,
        }
        for name, engine in engines.items():
            progress(f"  {name}: {engine.layout.describe()}")
        times, compiles = alternate_decode_timings(engines, slots, args.rounds, calls=16)
        library, server = times["LLM()"], times["jinfer serve"]
        ratio = paired_ratio(library, server)
        rows.append(
            {
                "slots": slots,
                "llm_step_ms": float(np.median(library)) * 1e3,
                "serve_step_ms": float(np.median(server)) * 1e3,
                "llm_over_serve": ratio["median"],
                "lowest_pair": ratio["lowest"],
                "highest_pair": ratio["highest"],
                "both_packed": all(e.layout.packed_weights for e in engines.values()),
                "compiles_in_measured_phase": compiles,
            }
        )
        progress(f"  {rows[-1]}")
        del engines
    columns = ["slots", "LLM() ms/step", "serve ms/step", "LLM / serve, median", "lowest / highest pair"]
    table = [
        [
            r["slots"],
            f"{r['llm_step_ms']:.1f}",
            f"{r['serve_step_ms']:.1f}",
            f"{r['llm_over_serve']:.2f}",
            f"{r['lowest_pair']:.2f} / {r['highest_pair']:.2f}",
        ]
        for r in rows
    ]
    write_results(args.out, "bench_doors", {"rows": rows}, markdown_table(columns, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
