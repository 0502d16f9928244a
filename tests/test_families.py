"""Model families (`jinfer.models.family`): a family defined outside jinfer (tests/toy_family.py, a
Llama with a GELU-gated MLP under its own model_type) loads, decodes in a crowd, scores and serves
(one process, or a cluster of two) through the engine, steps, device and server as they are; and
only `jinfer.models` names one."""

import os
import pathlib

import jax
import numpy as np
import openai
import pytest
import torch
import toy_family
from test_codebase import _imports, _modules
from test_server import KEY, TINY_OPTIONS, running_server

import jinfer
from jinfer.config import UnsupportedModelError
from jinfer.formats.hf import load_hf
from jinfer.models import family, llama
from jinfer.models.attention import TokenGroup

TESTS = str(pathlib.Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("toy"))
    return directory, toy_family.build(directory)


def _reference_greedy(model, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        lengths = {"max_new_tokens": tokens, "min_new_tokens": tokens}
        out = model.generate(torch.tensor([prompt]), **lengths, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def test_the_toy_family_is_its_own_function_not_llamas(toy):
    """The loaded weights through the toy family's pass and through Llama's differ: what the tests
    below compare is the family the checkpoint named, not Llama's."""
    loaded = load_hf(toy[0])
    assert family.family_of(loaded.config) is toy_family.FAMILY
    group = (TokenGroup(np.arange(3, 19)[None], np.arange(16)[None]),)
    hidden = lambda fam: jax.jit(lambda p: fam.forward_groups(p, group, loaded.config)[0][0])(loaded.params)
    toy_hidden, llama_hidden = hidden(toy_family.FAMILY), hidden(llama.FAMILY)
    assert np.abs(np.asarray(toy_hidden) - np.asarray(llama_hidden)).max() > 1e-2


def test_an_outside_family_decodes_in_a_crowd_and_scores_as_its_reference(toy):
    directory, model = toy
    llm = jinfer.LLM(directory, max_slots=4, max_seq_len=256)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 300, n).tolist() for n in (5, 12, 20)]
    greedy = jinfer.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    completions = llm.generate(prompts, greedy)  # three prompts in the engine's slots at once
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == _reference_greedy(model, prompt, 16)

    ids = rng.randint(3, 300, 40)
    with torch.no_grad():
        logits = model(torch.tensor(ids[None])).logits.float()
    reference = torch.log_softmax(logits, -1)[0, :-1].gather(-1, torch.tensor(ids[1:, None]))[:, 0].numpy()
    (ours,) = llm.score([ids.tolist()])
    assert np.abs(ours - reference).max() <= 1e-4 * np.ptp(reference)


def test_a_server_serves_a_family_named_in_its_environment(toy, monkeypatch):
    directory, _ = toy
    prompt = "Once upon a time"
    expected = jinfer.LLM(directory, max_slots=2, max_seq_len=128).generate(
        [prompt], jinfer.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    monkeypatch.setenv(family.ENVIRONMENT, "toy_family")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    with running_server(directory, *TINY_OPTIONS) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        answer = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
    assert answer.choices[0].text == expected.text


def test_a_cluster_serves_a_family_named_in_its_environment(toy, monkeypatch, tmp_path):
    """Two processes, one model over their four devices: each process finds the family through
    JINFER_FAMILIES, and the leader answers what one process on the same mesh answers."""
    from test_cluster import ENGINE, GREEDY, PROMPTS, serving

    directory, _ = toy
    one_process = jinfer.LLM(directory, mesh_data=2, mesh_model=2, **ENGINE)
    expected = [c.text for c in one_process.generate(PROMPTS, jinfer.SamplingParams(**GREEDY))]
    monkeypatch.setenv(family.ENVIRONMENT, "toy_family")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    with serving(directory, (2, 2), tmp_path) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        answers = [client.completions.create(model="tiny", prompt=p, **GREEDY) for p in PROMPTS]
    assert [a.choices[0].text for a in answers] == expected


def test_an_unknown_family_is_refused_by_name_and_a_name_is_read_by_one_family():
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'no_such_model'"):
        family.for_hf("no_such_model")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'jinfer_toy'"):
        family.for_gguf(toy_family.MODEL_TYPE)  # the toy family reads no GGUF
    with pytest.raises(ValueError, match="'llama' is already read by family 'llama'"):
        family.register(toy_family.FAMILY, ["llama"])


def test_a_family_module_that_does_not_import_is_named(monkeypatch):
    monkeypatch.setenv(family.ENVIRONMENT, "no_such_family_module")
    with pytest.raises(UnsupportedModelError, match="JINFER_FAMILIES names 'no_such_family_module'"):
        family.for_hf("llama")


def test_only_the_models_package_names_a_family():
    """The engine, steps, device, formats and server reach a family through `models.family`: none
    imports a family's own modules, so a new family touches `jinfer/models` alone."""
    modules = _modules()
    builtin = llama.FAMILY
    own = {f.__module__ for f in (builtin.param_specs, builtin.forward_groups, builtin.hf_config)}
    assert own == {"jinfer.models.llama", "jinfer.models.llama_params", "jinfer.models.llama_checkpoints"}
    naming = {
        name: sorted(_imports(name, path, modules) & own)
        for name, path in modules.items()
        if not name.startswith("jinfer.models")
    }
    assert {name: found for name, found in naming.items() if found} == {}
