"""Low-rank adapters (`jinfer.lora`): PEFT's adapters give transformers + peft's numbers, rows
without an adapter keep their bits, each row's tokens are the same alone and in any crowd of
adapters, and adapters load in memory with nothing compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny import VOCAB

import jinfer
from jinfer import SamplingParams, lora
from jinfer.formats.adapters import read_adapter, save_adapter
from jinfer.formats.params import CheckpointError
from jinfer.kernels import cpu_matmul
from jinfer.models.linear import project
from jinfer.models.params import PackedWeight
from jinfer.sampling import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(directory: str, adapter_dir: str, modules, rank: int, seed: int, **options):
    """transformers' model of `directory` with a random PEFT LoRA (B not zero), saved to adapter_dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False, **options
    )
    model = get_peft_model(base, config).eval()
    model.save_pretrained(adapter_dir)
    return model


def _ids(seed: int, length: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, VOCAB, length).tolist()


@pytest.mark.parametrize(
    "family, modules, rank, options",
    [
        ("llama_gqa_untied", ALL_MODULES, 4, {}),
        ("qwen2_bias_tied", ["q_proj", "v_proj", "down_proj"], 6, {"use_rslora": True}),
        ("qwen3_qknorm", ["k_proj", "o_proj", "gate_proj", "up_proj"], 2, {}),
    ],
)
def test_peft_adapters_score_and_decode_as_transformers_with_peft(
    family, modules, rank, options, tiny_model, tmp_path
):
    directory, _ = tiny_model(family)
    reference = _peft_model(directory, str(tmp_path), modules, rank, seed=1, **options)
    llm = jinfer.LLM(directory, max_seq_len=256, max_loras=2, max_lora_rank=8)
    llm.load_adapter("tuned", tmp_path)
    ids = _ids(2, 40)
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0]
        want = torch.log_softmax(logits, -1).numpy()[np.arange(39), ids[1:]]
    with reference.disable_adapter(), torch.no_grad():
        base_logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0], -1).numpy()
    assert np.abs(base_logp[np.arange(39), ids[1:]] - want).max() > 1e-2, "the adapter changes nothing"
    assert np.abs(llm.score([ids], adapter="tuned")[0] - want).max() <= 1e-4
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([ids[:10]]), max_new_tokens=12, do_sample=False)
    assert llm.generate([ids[:10]], GREEDY, adapter="tuned")[0].token_ids == greedy[0, 10:].tolist()


@pytest.fixture(scope="module")
def adapted(tiny_model, tmp_path_factory):
    """An engine holding two PEFT adapters of the tiny llama, and one holding none."""
    directory, _ = tiny_model("llama_gqa_untied")
    paths = [tmp_path_factory.mktemp(f"adapter{i}") for i in range(2)]
    for i, path in enumerate(paths):
        _peft_model(directory, str(path), ALL_MODULES[i:], rank=4 + 4 * i, seed=10 + i)
    llm = jinfer.LLM(directory, max_seq_len=256, max_slots=8, max_loras=4, max_lora_rank=8)
    for name, path in zip(("one", "two"), paths, strict=True):
        llm.load_adapter(name, path)
    plain = jinfer.LLM(directory, max_seq_len=256, max_slots=8)
    return llm, plain, paths


def _outputs(completions):
    return [(c.token_ids, [t["logprob"] for t in c.logprobs]) for c in completions]


def test_rows_without_an_adapter_keep_their_bits_and_each_row_its_own_in_a_crowd(adapted):
    llm, plain, _ = adapted
    prompts = [_ids(20 + i, 5 + 9 * i) for i in range(6)]
    names = ["one", None, "two", "one", None, "two"]
    alone = [_outputs(llm.generate([p], GREEDY, adapter=n))[0] for p, n in zip(prompts, names, strict=True)]
    crowd = _outputs(llm.generate(prompts, GREEDY, adapter=names))
    assert crowd == alone
    base = _outputs(plain.generate([p for p, n in zip(prompts, names, strict=True) if n is None], GREEDY))
    assert [alone[1], alone[4]] == base  # bit for bit the engine without adapters
    assert alone[0] != _outputs(plain.generate([prompts[0]], GREEDY))[0]
    assert alone[0] != _outputs(llm.generate([prompts[0]], GREEDY, adapter="two"))[0]


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_adapters_over_int8_weights_keep_each_row_its_own(adapted, tiny_model, activations):
    """Over quantized base weights (int8 blocks, multiplied in float32 or in int8), a row's adapter
    changes its tokens, rows without one are the quantized engine's bit for bit, and a crowd of
    adapters gives each row what it gets alone."""
    directory, _ = tiny_model("llama_gqa_untied")
    options = {"max_seq_len": 256, "max_slots": 8, "quantization": "int8"}
    options["quantized_activations"] = activations
    llm = jinfer.LLM(directory, **options, max_loras=2, max_lora_rank=8)
    for name, path in zip(("one", "two"), adapted[2], strict=True):
        llm.load_adapter(name, path)
    plain = jinfer.LLM(directory, **options)
    prompts = [_ids(60 + i, 6 + 5 * i) for i in range(4)]
    names = ["one", None, "two", None]
    alone = [_outputs(llm.generate([p], GREEDY, adapter=n))[0] for p, n in zip(prompts, names, strict=True)]
    assert _outputs(llm.generate(prompts, GREEDY, adapter=names)) == alone
    assert [alone[1], alone[3]] == _outputs(plain.generate([prompts[1], prompts[3]], GREEDY))
    assert alone[0] != _outputs(plain.generate([prompts[0]], GREEDY))[0]


def test_sampled_log_probs_are_the_adapters_scores_bit_for_bit_in_a_crowd(adapted):
    llm = adapted[0]
    assert llm.engine.layout.attention_kernel == "cpu"
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=12, logprobs=0)
    prompts = [_ids(50 + i, 4 + 7 * i) for i in range(4)]
    names = ["one", "two", None, "one"]
    for params in (GREEDY, seeded):
        for prompt, name, out in zip(
            prompts, names, llm.generate(prompts, params, adapter=names), strict=True
        ):
            (scores,) = llm.score([prompt + out.token_ids], adapter=name)
            sampled = np.array([entry["logprob"] for entry in out.logprobs], np.float32)
            assert np.array_equal(sampled, scores[len(prompt) - 1 :])


def test_an_adapter_from_memory_loads_with_no_compile_and_swaps_per_request(adapted, tiny_model):
    llm, _, paths = adapted
    cfg = llm.engine.model_config
    prompt = _ids(40, 12)
    llm.generate([prompt], GREEDY, adapter="one")  # every program warm
    compiles = llm.engine.compile_count()
    first = read_adapter(str(paths[0]), cfg)
    doubled = jax_tree_scaled(first, 2.0)
    llm.load_adapter("fresh", doubled)
    fresh = _outputs(llm.generate([prompt], GREEDY, adapter="fresh"))
    assert fresh != _outputs(llm.generate([prompt], GREEDY, adapter="one"))
    # A request running on "fresh" when the name is given another adapter finishes on its own.
    engine = llm.engine
    results = {}
    prepared = llm.preparer.prepare(prompt, sampling=GREEDY, adapter="fresh")
    engine.submit(prepared, lambda out: results.setdefault("tokens", []).extend(out.token_ids))
    engine.step()
    llm.load_adapter("fresh", first)  # the running request holds its slot: another slot takes it
    while "tokens" not in results or len(results["tokens"]) < GREEDY.max_tokens:
        engine.step()
    assert results["tokens"] == fresh[0][0]
    assert _outputs(llm.generate([prompt], GREEDY, adapter="fresh")) == _outputs(
        llm.generate([prompt], GREEDY, adapter="one")
    )
    llm.unload_adapter("fresh")
    with pytest.raises(RequestError, match="no adapter named 'fresh'"):
        llm.generate([prompt], GREEDY, adapter="fresh")
    assert llm.engine.compile_count() == compiles


@pytest.mark.parametrize("columns", [1, 7, 45])
def test_the_fused_kernel_adds_the_deltas_the_separate_products_do_bit_for_bit(adapted, columns):
    """Each weight's deltas in one kernel call (`lora.FusedAdaptedWeight`) are the separate
    products' (A's, then each projection's B, added side by side) bit for bit: with columns on no
    adapter, on an empty slot and on each held one, narrower and wider than one call takes; and a
    one-slot stack over every column, as a trainer's forward applies one adapter."""
    llm = adapted[0]
    assert cpu_matmul.lora_deltas_available()
    cfg, slots = llm.engine.model_config, llm.engine.adapters
    pack = lambda w: PackedWeight(w, cpu_matmul.pack(w))

    def both_ways(adapters):
        stack = lora.stack(adapters, cfg, slots.rank, slots.targets)
        fused = lora.fused(stack, cfg, cpu_matmul.pack, cpu_matmul.block_rows())
        layers = [
            {w: lora.WeightPairs(pack(p.a), tuple(map(pack, p.bs))) for w, p in layer.items()}
            for layer in stack.layers
        ]
        return fused, stack.replace(layers=tuple(layers))

    rows = np.random.default_rng(columns).integers(-1, len(slots.held), columns)
    rows[: min(columns, 3)] = [0, -1, 1][: min(columns, 3)]
    cases = [(both_ways(slots.held), rows), (both_ways(slots.held[:1]), None)]
    assert isinstance(cases[0][0][0].layers[0]["wqkv"], lora.FusedPairs)
    inputs = {t.weight: t.in_features for t in lora.targets_of(cfg, slots.targets).values()}
    product = jax.jit(lambda weight, x, dims: project(weight, x, dims), static_argnums=2)
    for layer in (0, cfg.num_layers - 1):
        one = llm.engine.params.replace(layers=(llm.engine.params.layers[layer],))
        draw = np.random.default_rng(layer).standard_normal
        x_of = {n: jnp.asarray(draw((n, columns)), jnp.float32) for n in {*inputs.values()}}
        for stacks, columns_slots in cases:
            held = [
                lora.adapted(one, cfg, s.replace(layers=(s.layers[layer],)), columns_slots) for s in stacks
            ]
            for weight in inputs:
                x, dims = x_of[inputs[weight]], 2 if weight == "wo" else 1
                got, want = (np.asarray(product(getattr(p.layers[0], weight), x, dims)) for p in held)
                assert np.array_equal(got, want), weight
                plain = np.asarray(project(getattr(one.layers[0], weight), x, dims))
                kept = rows < 0 if columns_slots is not None else np.zeros(columns, bool)
                assert np.array_equal(got[..., kept], plain[..., kept])
                assert not np.array_equal(got[..., ~kept], plain[..., ~kept])


def jax_tree_scaled(adapter: lora.Adapter, factor: float) -> lora.Adapter:
    layers = [{k: lora.LoraPair(p.a, p.b * factor) for k, p in layer.items()} for layer in adapter.layers]
    return lora.Adapter(tuple(layers), adapter.config)


def test_no_prefix_page_crosses_adapters(adapted):
    llm, _, _ = adapted
    prompt = _ids(50, 200)  # three full pages of 64
    kv = llm.engine.kv
    llm.generate([prompt], GREEDY, adapter="one")
    hits = kv.hits
    base = llm.generate([prompt], GREEDY)
    assert kv.hits == hits, "the base model found pages the adapter computed"
    llm.generate([prompt], GREEDY, adapter="two")
    assert kv.hits == hits
    again = llm.generate([prompt], GREEDY, adapter="one")
    assert kv.hits > hits  # its own pages are found
    assert _outputs(again) == _outputs(llm.generate([prompt], GREEDY, adapter="one"))
    assert _outputs(base) != _outputs(again)


def test_adapters_save_restore_and_refusals(adapted, tmp_path):
    llm, plain, paths = adapted
    cfg = llm.engine.model_config
    adapter = read_adapter(str(paths[1]), cfg)
    save_adapter(str(tmp_path / "mine"), adapter, cfg)
    restored = read_adapter(str(tmp_path / "mine"), cfg)
    assert restored.config == adapter.config
    for got, want in zip(restored.layers, adapter.layers, strict=True):
        for name in want:
            assert np.array_equal(got[name].a, want[name].a) and np.array_equal(got[name].b, want[name].b)
    with pytest.raises(ValueError, match="max_loras"):
        plain.load_adapter("x", adapter)
    wide = lora.init_adapter(cfg, lora.LoraConfig(rank=16), jax_key())
    with pytest.raises(ValueError, match="max_lora_rank is 8"):
        llm.load_adapter("wide", wide)
    with pytest.raises(CheckpointError, match="neither a PEFT adapter"):
        llm.load_adapter("nothing", tmp_path)
    with pytest.raises(RequestError, match="no adapter named 'missing'"):
        llm.score([[1, 2, 3]], adapter="missing")


def jax_key():
    import jax

    return jax.random.key(0)
