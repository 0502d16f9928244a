"""How long `jinfer serve` takes to be ready: a first start (an empty compile cache) and restarts
(the programs loaded from it), each part as the server's log tells it.

    python scripts/bench_start.py [--restarts 3] [--out results] [-- serve options...]

Each start is a `jinfer serve` process of its own on the embedded model (or --model in the serve
options) with `--compile-cache` pointing at a folder this script empties first; the time to ready
is from the process's start to the first `/ready` 200, polled every 50 ms. The parts: the model's
load and the warm-up (their seconds, and how many programs the warm-up compiled or loaded), read
from the log; the rest (Python's imports, binding, the app) is what is left. Writes
results/bench_start.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
from benchlib import markdown_table, progress, write_results

LOADED = re.compile(r"loaded in ([\d.]+) s")
WARM_UP = re.compile(r"warm-up: ([\d.]+) s; (\d+) programs in [\d.]+ s \((\d+) loaded from the compile cache")


def start_once(folder: str, serve_options: list[str], port: int) -> dict:
    """One `jinfer serve` on `folder`, from its start to /ready, then stopped: the seconds, and
    the parts its log names."""
    command = [sys.executable, "-m", "jinfer.cli", "serve", "--port", str(port), "--compile-cache", folder]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([*command, *serve_options], stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError("the server exited:\n" + log.read())
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                        break
                time.sleep(0.05)
            ready_s = time.perf_counter() - start
        finally:
            proc.terminate()
            proc.wait()
        log.seek(0)
        text = log.read()
    load_s = float(LOADED.search(text).group(1))
    warm_s, programs, loaded = WARM_UP.search(text).groups()
    return {
        "ready_s": ready_s,
        "load_s": load_s,
        "warm_up_s": float(warm_s),
        "rest_s": ready_s - load_s - float(warm_s),
        "programs": int(programs),
        "loaded_from_cache": int(loaded),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", default="results")
    parser.add_argument("serve_options", nargs=argparse.REMAINDER, help="-- then `jinfer serve` options")
    args = parser.parse_args()
    serve_options = [a for a in args.serve_options if a != "--"]
    folder = tempfile.mkdtemp(prefix="jinfer-compile-cache-")
    try:
        starts = []
        for i in range(1 + args.restarts):
            progress("first start (an empty compile cache)" if i == 0 else f"restart {i}")
            starts.append(start_once(folder, serve_options, args.port))
            progress(f"  ready after {starts[-1]['ready_s']:.1f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seconds = ("ready_s", "load_s", "warm_up_s", "rest_s")
    rows = [
        [
            "first start" if i == 0 else f"restart {i}",
            *(f"{s[k]:.1f}" for k in seconds),
            f"{s['programs']} ({s['loaded_from_cache']})",
        ]
        for i, s in enumerate(starts)
    ]
    columns = ["start", "ready s", "model load s", "warm-up s", "the rest s", "programs (from the cache)"]
    result = {"serve_options": serve_options, "starts": starts}
    write_results(args.out, "bench_start", result, markdown_table(columns, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
