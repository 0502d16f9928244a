"""Shared pieces of the benchmark scripts: progress lines, the hardware ceiling, benchmark models
built offline, peers (transformers, llama.cpp) and writing results (JSON + markdown + PNG).

Every benchmark measures its ceiling and its peers in the same run as jinfer, because these
machines are shared and noisy: only ratios taken side by side mean much.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.models import quantized
from jinfer.models.params import unpacked

LLAMA_CPP_VERSION = "0.3.36"
PROMPT = "Once upon a time, there was a little"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_ceiling(repeats: int = 5, matmul_dtype=jnp.float32, matmul_side: int = 2048) -> dict[str, float]:
    """Memory bandwidth (best of repeated 1 GiB float32 reductions and matrix-vector products) and
    matmul GFLOP/s (a square product of `matmul_side` in `matmul_dtype`).

    Each timing runs enough calls back to back to last ~50 ms, so that on a fast accelerator the
    dispatch of one call (tens of microseconds) does not count against a 0.3 ms reduction."""
    n = 2**28  # 1 GiB of float32
    x = jnp.ones((n,), jnp.float32)
    side = 2**14
    matrix, vector = x.reshape(side, side), jnp.ones((side,), jnp.float32)
    a = jnp.ones((matmul_side, matmul_side), matmul_dtype)
    best = {"reduction": 0.0, "matvec": 0.0, "matmul": 0.0}
    cases = (
        (jax.jit(jnp.sum), (x,), "reduction", n * 4 / 1e9),
        (jax.jit(jnp.dot), (matrix, vector), "matvec", n * 4 / 1e9),
        (jax.jit(jnp.matmul), (a, a), "matmul", 2 * matmul_side**3 / 1e9),
    )
    for fn, args, key, amount in cases:
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        calls = max(1, round(0.05 / (time.perf_counter() - start)))
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready([fn(*args) for _ in range(calls)])
            best[key] = max(best[key], calls * amount / (time.perf_counter() - start))
    return {
        "bandwidth_gb_s": max(best["reduction"], best["matvec"]),
        "reduction_gb_s": best["reduction"],
        "matvec_gb_s": best["matvec"],
        "matmul_gflop_s": best["matmul"],
        "matmul_dtype": jnp.dtype(matmul_dtype).name,
    }


def decode_weight_bytes(params) -> int:
    """Bytes of weights one decode step reads: all of them, less an untied input embedding (it is
    gathered one row per token); of a matrix with a packed copy, one of the two."""
    params = unpacked(params)
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    if params.lm_head is not None:
        total -= sum(a.nbytes for a in jax.tree.leaves(params.embed))
    return total


def transformers_decode(model, input_ids, batch: int, tokens: int) -> float:
    """transformers `generate()` decode tokens/s (greedy, exactly `tokens` new tokens): the time of
    a `tokens`-token generation less that of a 1-token one (the prefill)."""
    import torch

    ids = input_ids.repeat(batch, 1)
    fixed = {"attention_mask": torch.ones_like(ids), "pad_token_id": 0, "do_sample": False}

    def generate(new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **fixed)
        return time.perf_counter() - start

    with torch.no_grad():
        generate(2)  # warm
        prefill = generate(1)
        total = generate(tokens)
    return batch * (tokens - 1) / (total - prefill)


def time_decode_calls(
    engine, slots: int, reach: int, calls: int, position: int | None = None, adapters=None
) -> float:
    """Seconds per decode step over `calls` back-to-back calls of the engine's compiled decode for
    `slots` slots (over the attention bucket holding `reach` positions), on the engine's own cache
    and state, which it keeps afterwards (they are donated). Each slot reads and writes pages of its
    own (as many as a full-length sequence has: the pool must hold slots x max_seq_len positions).
    With `position`, every slot starts there; otherwise where the engine's requests left it.
    `adapters` [slots]: each row's slot in the engine's adapter stack (default: none)."""
    from jinfer.inputs import Program, neutral_inputs
    from jinfer.kv_cache import contiguous_tables

    decode = engine.steps.programs[Program("decode", slots, engine.steps.attention_bucket(reach))]
    layout = engine.layout
    tables = contiguous_tables(layout.max_slots, layout.max_seq_len, layout.page_size)
    if tables.max() >= layout.num_pages:
        raise ValueError("time_decode_calls needs a pool of max_slots x max_seq_len positions")
    tables = engine.steps.put_tables(tables)
    every_step = np.full(slots, layout.decode_steps, np.int32)  # every slot, every step
    inputs = neutral_inputs(slots).replace(steps=every_step, allowed=engine.steps.unconstrained)
    if adapters is not None:
        inputs = inputs.replace(adapter=np.asarray(adapters, np.int32))
    cache, state = engine.device.cache, engine.device.state
    if position is not None:
        state = state.replace(positions=jnp.full_like(state.positions, position))
    start = time.perf_counter()
    for _ in range(calls):
        cache, state, out = decode(engine.device.weights, cache, state, tables, inputs, None)
    out.rows.tokens.block_until_ready()
    engine.device.cache, engine.device.state = cache, state
    return (time.perf_counter() - start) / (calls * engine.layout.decode_steps)


def alternate_decode_timings(
    engines: dict, slots: int, rounds: int, calls: int = 8, position: int = 100
) -> tuple[dict[object, np.ndarray], int]:
    """Seconds per decode step of each engine's compiled decode, timed in `rounds` alternating
    rounds after one warm-up call each: ({key: [rounds] array}, compiles during the rounds)."""
    reach = position + calls * max(e.layout.decode_steps for e in engines.values()) + 1
    for engine in engines.values():
        time_decode_calls(engine, slots, reach, calls, position=position)  # compiles, warms up
    before = sum(engine.compile_count() for engine in engines.values())
    times = {key: [] for key in engines}
    for _ in range(rounds):
        for key, engine in engines.items():
            times[key].append(time_decode_calls(engine, slots, reach, calls, position=position))
    compiles = sum(engine.compile_count() for engine in engines.values()) - before
    return {key: np.array(t) for key, t in times.items()}, compiles


def paired_ratio(numerator: np.ndarray, denominator: np.ndarray) -> dict[str, float]:
    """The median of paired ratios and the lowest and highest pair."""
    ratios = numerator / denominator
    return {"median": float(np.median(ratios)), "lowest": float(ratios.min()), "highest": float(ratios.max())}


def matrix_params(params) -> tuple[int, int]:
    """(weights in all layers, the output projection): what each token's matrix products multiply."""
    params = unpacked(params)
    leaves = lambda tree: jax.tree.leaves(tree, is_leaf=quantized.is_quantized)
    weights = lambda tree: sum(math.prod(w.shape) for w in leaves(tree))
    return weights(params.layers), weights(params.lm_head if params.lm_head is not None else params.embed)


def attention_flops(cfg, queries: int, keys: int) -> int:
    """QK^T and PV for `queries` query positions against `keys` key positions (no causal saving)."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * queries * keys


def prefill_flops(cfg, params, tokens: int, cached: int = 0) -> int:
    """Useful FLOPs of one prefill: weight products for every token, causal attention (over
    `cached` earlier positions too), one logits row."""
    layers, output = matrix_params(params)
    attention = attention_flops(cfg, tokens, tokens) // 2 + attention_flops(cfg, tokens, cached)
    return 2 * layers * tokens + 2 * output + attention


def export_hf_from_gguf(gguf_path: str, directory: str) -> str:
    """A float32 Hugging Face directory holding exactly the GGUF's (dequantized) weights and its
    tokenizer: what transformers and llama.cpp's converter read."""
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    os.makedirs(directory, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory


def random_llama_dir(
    directory: str, tokenizer_dir: str, *, hidden=1024, layers=16, mlp=2816, heads=16, kv_heads=4
) -> str:
    """A random-weight Llama-shaped model (~0.9 GB float32 by default) written as a Hugging Face
    directory, reusing `tokenizer_dir`'s tokenizer (its vocabulary sets the embedding size)."""
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    from safetensors.numpy import save_file

    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = max(tokenizer["model"]["vocab"].values()) + 1
    vocab = max([vocab] + [t["id"] + 1 for t in tokenizer.get("added_tokens", [])])
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    normal = lambda *shape: 0.02 * rng.standard_normal(shape, dtype=np.float32)
    state = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(mlp, hidden),
            p + "mlp.up_proj.weight": normal(mlp, hidden),
            p + "mlp.down_proj.weight": normal(hidden, mlp),
        }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tokenizer_dir, name), directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(state, os.path.join(directory, "model.safetensors"))
    return directory


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_source(source_dir: str, wanted: tuple[str, ...]) -> str:
    """llama.cpp's tree as vendored in the llama-cpp-python source distribution (downloaded from
    PyPI into source_dir once), with the paths starting with `wanted` extracted ("" the whole tree,
    known by its CMakeLists.txt); returns its root."""
    root = os.path.join(source_dir, f"llama_cpp_python-{LLAMA_CPP_VERSION}", "vendor", "llama.cpp")
    if all(os.path.exists(os.path.join(root, w or "CMakeLists.txt")) for w in wanted):
        return root
    os.makedirs(source_dir, exist_ok=True)
    archive = os.path.join(source_dir, f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz")
    if not os.path.exists(archive):
        package = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
        download = ["pip", "download", "-q", "--no-deps", "--no-binary", ":all:", package, "-d", source_dir]
        subprocess.run([sys.executable, "-m", *download], check=True)
    prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(wanted)
        ]
        tar.extractall(source_dir, members=members, filter="data")
    return root


def llama_cpp_f32_gguf(hf_dir: str, out_path: str, source_dir: str) -> str:
    """Write hf_dir as an F32 GGUF with llama.cpp's own convert_hf_to_gguf.py, taken from the
    llama-cpp-python source distribution (downloaded from PyPI into source_dir once)."""
    if os.path.exists(out_path):
        return out_path
    root = llama_cpp_source(source_dir, ("convert_hf_to_gguf.py", "gguf-py/", "conversion/"))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "gguf-py"))
    subprocess.run(
        [
            sys.executable,
            os.path.join(root, "convert_hf_to_gguf.py"),
            hf_dir,
            "--outtype",
            "f32",
            "--outfile",
            out_path,
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    return out_path


@contextlib.contextmanager
def git_worktree(revision: str):
    """A temporary checkout of `revision` of this repository (its folder), removed afterwards."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix="jinfer-baseline-")
    subprocess.run(["git", "-C", here, "worktree", "add", "--detach", folder, revision], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", here, "worktree", "remove", "--force", folder], check=False)


def write_results(out_dir: str, name: str, result: dict, table: str) -> None:
    """results/<name>.json and results/<name>.md (the table is also printed)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    print(table)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "n/a"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
