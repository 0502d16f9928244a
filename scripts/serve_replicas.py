"""Replicas of `jinfer serve` behind an existing router from PyPI: the local recipe of
docs/scale.md.

    python scripts/serve_replicas.py [--replicas 2] [--port 8000] [--policy cache_aware]
                                     [--router vllm|sglang] [-- jinfer serve flags ...]

Starts the replicas on free loopback ports (each with the `jinfer serve` flags given after `--`),
waits until every one is ready, then starts the router on --port in front of them: vLLM's router
(`pip install vllm-router==0.1.17`) or SGLang's (`pip install sglang-router==0.3.2`); both are
Rust binaries, both route OpenAI requests by policy (`cache_aware`: to the replica whose earlier
requests share the longest prefix with this one, while the load stays balanced; `round_robin`,
`power_of_two`, ...). Prints the URLs and runs until SIGINT / SIGTERM, which stops everything.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROUTERS = {"vllm": "vllm_router.launch_router", "sglang": "sglang_router.launch_router"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(url: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Until GET url answers 200; fails if a process exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited before {url} answered")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.5)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--router", choices=sorted(ROUTERS), default="vllm")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the replicas to warm up")
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for every `jinfer serve`")
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops everything, as Ctrl-C does
    try:
        workers = []
        for _ in range(args.replicas):
            port = free_port()
            serve = [sys.executable, "-m", "jinfer.cli", "serve", "--port", str(port), *args.serve_flags]
            procs.append(subprocess.Popen(serve))
            workers.append(f"http://127.0.0.1:{port}")
        for worker in workers:
            wait_until(worker + "/ready", procs, args.timeout)
        router = [sys.executable, "-m", ROUTERS[args.router], "--host", "127.0.0.1", "--port", str(args.port)]
        router += ["--worker-urls", *workers, "--policy", args.policy, "--prometheus-port", str(free_port())]
        procs.append(subprocess.Popen(router))
        wait_until(f"http://127.0.0.1:{args.port}/v1/models", procs, 60)
        print(f"router http://127.0.0.1:{args.port} ({args.policy}) -> {' '.join(workers)}", flush=True)
        procs[-1].wait()
        return 1  # the router exited on its own
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
