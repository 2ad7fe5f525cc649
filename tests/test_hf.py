"""transformers integration: save/load round trips, trust_remote_code without meshlm, generate()
with the cache."""
import ast
import json
import os
import sys

import pytest
import torch
from conftest import build, tiny
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from meshlm.data.tokenizer import load_tokenizer
from meshlm.hf import MeshForCausalLM, from_meshlm, save_hf
from meshlm.hf.remote import modeling_source
from meshlm.model import SCHEMES

VOCAB = 8192  # the shipped tokenizer's vocabulary


def spec_for(scheme: str) -> str:
    return "1+2+1+1" if scheme == "vanilla" else "1+2R2+1"


def left_padded_batch(vocab, lengths=(5, 2, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :width - n], mask[row, width - n:] = 1, 1
    return ids, mask


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_save_load_round_trip_is_exact(scheme, tmp_path):
    model = build(tiny(scheme=scheme, spec=spec_for(scheme), vocab_size=VOCAB))
    save_hf(model, tmp_path)
    # registered: no trust_remote_code needed
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MeshForCausalLM)
    x = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert loaded.config.num_hidden_layers == model.config.layout.unrolled_depth


def test_folder_contents_and_tokenizer(tmp_path):
    save_hf(build(tiny(vocab_size=VOCAB)), tmp_path)
    names = set(os.listdir(tmp_path))
    assert {"model.safetensors", "config.json", "tokenizer.json", "configuration_meshlm.py",
            "modeling_meshlm.py"} <= names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_meshlm.MeshForCausalLM"
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ours = load_tokenizer("default")
    text = "To be, or not to be: that is the question."
    assert tok(text).input_ids == ours.encode(text)
    assert (tok.eos_token_id, tok.pad_token_id) == (ours.eos_id, ours.pad_id)
    batch = tok(["Hello", "To be, or not to be"], padding=True).attention_mask
    # pads before the prompt
    assert tok.padding_side == "left" and batch[0][0] == 0 and batch[0][-1] == 1


def test_model_card_states_spec_scheme_training_and_loading(tmp_path, prepared):
    from evalkit import tiny_checkpoint

    from meshlm.cli import main

    run = tiny_checkpoint(tmp_path, "mesh", prepared)
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    for fact in ("`1+2R2+1`", "state scheme: `mesh` (5 slots)", f"training data: {prepared}",
                 "training tokens: 128 (1 steps)", "trust_remote_code=True",
                 "pipeline(\"text-generation\"",
                 "lm_eval --model hf"):
        assert fact in card, fact
    bare = save_hf(build(tiny(vocab_size=VOCAB)), tmp_path / "bare")
    assert "training: not recorded" in (bare / "README.md").read_text()


def test_batched_pipeline_output_equals_one_prompt_at_a_time(tmp_path):
    """Left padding: a short prompt batched beside a long one continues exactly as it does alone."""
    from transformers import pipeline

    save_hf(build(tiny(scheme="mesh", spec="1+2R2+1", vocab_size=VOCAB)), tmp_path)
    generate = pipeline("text-generation", model=str(tmp_path), device="cpu")
    prompts = ["Hi", "To be, or not to be, that is the question: whether"]
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_full_text=False)
    alone = [generate(p, **kwargs)[0]["generated_text"] for p in prompts]
    batched = [out[0]["generated_text"] for out in generate(prompts, batch_size=2, **kwargs)]
    assert batched == alone and all(alone)
    # the same with the tokenizer and generate() directly (the pipeline pads by itself; a user's
    # batch does not)
    tok, model = (AutoTokenizer.from_pretrained(tmp_path),
                  AutoModelForCausalLM.from_pretrained(tmp_path))
    out = model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=8,
                         min_new_tokens=8,
                         do_sample=False)
    assert tok.batch_decode(out[:, -8:]) == alone


def test_generated_modeling_file_is_self_contained():
    tree = ast.parse(modeling_source())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 1 or not (node.module or "").startswith("meshlm"), node.module
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("meshlm") for a in node.names)


def test_bundled_sources_are_what_the_entry_imports_in_the_order_they_run(tmp_path):
    """A package of its own: top-level imports come first, a function's import may come later, a
    package that only re-exports leads to the defining module, and neither a module nothing imports
    nor one imported only for type checking is bundled."""
    from meshlm.hf.sources import bundle_sources

    files = {"entry.py": "import torch\nfrom meshlm.a import f\n\n\ndef g():\n"
                         "    from meshlm.late import h\n    return h\n",
             "a.py": "from typing import TYPE_CHECKING\n\nfrom meshlm.pkg import Thing\n\n"
                     "if TYPE_CHECKING:\n    from meshlm.typed import T\n\nf = Thing\n",
             "pkg/__init__.py": "from meshlm.pkg.impl import Thing\n"
                                "from meshlm.pkg import unused\n",
             "pkg/impl.py": "from meshlm.base import x\nThing = x\n", "pkg/unused.py": "",
             "base.py": "x = 1\n", "late.py": "from meshlm.base import x\nh = x\n",
             "typed.py": "T = 1\n", "nobody.py": "from meshlm.base import x\n"}
    for rel, text in files.items():
        (tmp_path / "meshlm" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "meshlm" / rel).write_text(text)
    order = bundle_sources("meshlm.entry", tmp_path / "meshlm")
    assert order == ("base.py", "pkg/impl.py", "a.py", "entry.py", "late.py")
    given = frozenset({"meshlm.pkg.impl"})  # supplied another way: not followed
    assert bundle_sources("meshlm.a", tmp_path / "meshlm", given) == ("a.py",)
    named = bundle_sources("meshlm.entry", tmp_path / "meshlm", also=("meshlm.nobody", "meshlm.a"))
    assert named == (*order, "nobody.py")  # a module reached by name comes after, once


def test_exported_folder_carries_the_modules_its_features_import_and_no_others():
    """Every backbone's layers (the registry names their modules) and every scheme are bundled
    because the model needs them (no list to extend); modules the remote code never imports are
    not, nor the package re-exports."""
    from meshlm.backbones import BACKBONES
    from meshlm.hf.remote import bundled_modules, sources

    bundled, text = bundled_modules(), modeling_source()
    features = {"meshlm.generate.speculative", "meshlm.generate.planner", "meshlm.model.exit",
                "meshlm.model.recompute", "meshlm.hf.modeling"}
    layers = {b.layer.__module__ for b in BACKBONES.values()}
    schemes = {cls.__module__ for cls in SCHEMES.values()}
    assert features | layers | schemes <= bundled
    for absent in ("model/accounting.py", "model/__init__.py", "generate/__init__.py",
                   "hf/remote.py", "hf/configuration.py", "serve/batcher.py", "loading.py"):
        assert absent not in sources() and f"meshlm/{absent} ==" not in text, absent
    assert sources()[-1] == "hf/modeling.py" and len(set(sources())) == len(sources())


def test_bundler_rewrites_every_meshlm_import_form_and_refuses_the_rest():
    from meshlm.hf.remote import BundleError, _localize_imports

    source = ("from meshlm.a import x\nfrom meshlm.a import x as y  # noqa\nfrom meshlm.model "
              "import llama\nimport meshlm.model.moe as experts\nimport torch\n\n\ndef f():\n    "
              "from meshlm.b import (\n        later as z,\n    )\n    return z\n")
    out = _localize_imports(source, "t.py", earlier={"x"}, everywhere={"x", "later"}).splitlines()
    assert out[:5] == ["pass", "y = x  # noqa", "llama = _BundledModule('meshlm.model.llama')",
                       "experts = _BundledModule('meshlm.model.moe')", "import torch"]
    assert out[8:11] == ["    z = later", "", ""]
    refused = {"import meshlm.config\n": "import meshlm.config` cannot be bundled",
               "from .x import y\n": "relative import",
               "from meshlm.a import nowhere\n": "`nowhere` from meshlm.a is not defined",
               "from meshlm.a import later\n": "`later` from meshlm.a is not defined by a bundled "
                                               "source before it",
               "if True: from meshlm.a import x\n": "on a line of its own"}
    for text, message in refused.items():
        with pytest.raises(BundleError, match=message):
            _localize_imports(text, "t.py", earlier={"x"}, everywhere={"x", "later"})


@pytest.mark.parametrize("first, second", [
    ("from dataclasses import replace\n", "def replace():\n    pass\n"),  # imported, then defined
    ("def replace():\n    pass\n", "from dataclasses import replace\n"),  # defined, then imported
    ("def f():\n    pass\n", "f = 1\n")])
def test_bundler_refuses_one_top_level_name_bound_by_two_sources(tmp_path, monkeypatch, first,
                                                                 second):
    """In the one generated file a later binding replaces an earlier one for every source: a
    library name and a meshlm function of the same name would silently call the wrong one."""
    from meshlm.hf import remote

    (tmp_path / "a.py").write_text(first)
    (tmp_path / "b.py").write_text(second)
    monkeypatch.setattr(remote, "PACKAGE", tmp_path)
    monkeypatch.setattr(remote, "sources", lambda: ("a.py", "b.py"))
    with pytest.raises(remote.BundleError, match="meshlm/b.py .*'(replace|f)'.*meshlm/a.py"):
        remote.modeling_source.__wrapped__()


def test_generated_code_runs_as_its_own_package(tmp_path):
    """Fast in-process stand-in for the fresh-process test: the generated module alone builds the
    same model."""
    import importlib

    model = build(tiny(scheme="dynamic-mix", vocab_size=VOCAB))
    save_hf(model, tmp_path / "pkg_meshlm_remote")
    (tmp_path / "pkg_meshlm_remote" / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        remote = importlib.import_module("pkg_meshlm_remote.modeling_meshlm")
    finally:
        sys.path.remove(str(tmp_path))
    loaded = remote.MeshForCausalLM.from_pretrained(tmp_path / "pkg_meshlm_remote").eval()
    assert type(loaded.model).__module__ == "pkg_meshlm_remote.modeling_meshlm"
    x = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


# Every documented way to call the exported model's generate(), as code both this process (meshlm's
# own class) and the clean one (the folder's remote code) run: plain greedy, speculation by name,
# the assistant knobs as arguments and in a GenerationConfig, sampled speculation, and config.loops
# / config.exit.
GENERATE_CALLS = """
import torch
from transformers import GenerationConfig


def generate_calls(model, ids, mask):
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    knobs = GenerationConfig(assistant_early_exit=1, num_assistant_tokens=2, max_new_tokens=8,
                             do_sample=False)
    out = {"greedy": model.generate(**common),
           "speculate": model.generate(**common, speculate="1:2"),
           "auto": model.generate(**common, speculate="auto"),
           "assistant_knobs": model.generate(**common, assistant_early_exit=1,
                                             num_assistant_tokens=3),
           "generation_config": model.generate(ids, attention_mask=mask, generation_config=knobs)}
    torch.manual_seed(0)
    out["sampled_speculate"] = model.generate(**{**common, "do_sample": True}, top_k=20,
                                              speculate="1:2")
    model.config.loops, model.config.exit = 3, "state:0.3"
    out["loops_exit"] = model.generate(**common)
    model.config.loops = model.config.exit = None
    return out
"""


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: ~10 s
def test_exported_folder_runs_every_generate_feature_where_meshlm_cannot_be_imported(tmp_path):
    """The folder's own code, in a clean process with meshlm blocked, gives meshlm's logits and
    generate() outputs exactly, for every call in GENERATE_CALLS, in a pipeline, and after saving
    the remote model again."""
    from cleanenv import run_without_meshlm

    folder = tmp_path / "mesh-model"
    model = build(tiny(scheme="mesh", spec="1+2R2+1", max_loops=4, vocab_size=VOCAB))
    save_hf(model, folder)
    x, mask = left_padded_batch(VOCAB)
    namespace = {}
    exec(GENERATE_CALLS, namespace)
    ours = namespace["generate_calls"](from_meshlm(model), x, mask)
    assert all(torch.equal(ours[name], ours["greedy"])
               for name in ("speculate", "auto", "assistant_knobs",
                                                                      # lossless
                                                                      "generation_config"))
    with torch.no_grad():
        logits = model(x, padding_mask=mask).logits
    torch.save({"x": x, "mask": mask, "logits": logits, "generated": ours}, tmp_path / "ref.pt")
    run_without_meshlm(GENERATE_CALLS + f"""
from transformers import AutoModelForCausalLM, pipeline
folder, ref = {str(folder)!r}, torch.load({str(tmp_path / "ref.pt")!r})
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
# the folder's code
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    logits = model(ref["x"], attention_mask=ref["mask"]).logits
assert (logits - ref["logits"])[ref["mask"].bool()].abs().max().item() <= 1e-6
for name, out in generate_calls(model, ref["x"], ref["mask"]).items():
    assert torch.equal(out, ref["generated"][name]), name
text = pipeline("text-generation", model=folder, trust_remote_code=True)("Hi", max_new_tokens=4,
                                                                        do_sample=False)
assert text[0]["generated_text"].startswith("Hi")
model.save_pretrained({str(tmp_path / "again")!r})  # the remote code copies itself
again = AutoModelForCausalLM.from_pretrained({str(tmp_path / "again")!r},
                                             trust_remote_code=True).eval()
with torch.no_grad():
    assert torch.equal(again(ref["x"], attention_mask=ref["mask"]).logits, logits)
""", tmp_path)


def test_dynamic_cache_gets_one_entry_per_unrolled_layer():
    """The public Cache API (update/get_seq_length) is all the model uses; transformers'
    DynamicCache works."""
    hf = from_meshlm(build(tiny(spec="1+2R2+1")))
    ids, mask = left_padded_batch(97)
    cache = DynamicCache()
    with torch.no_grad():
        out = hf(ids, attention_mask=mask, cache=cache, use_cache=True)
        nxt = torch.tensor([[5], [6], [7]])
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        step = hf(nxt, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
        full = hf(torch.cat([ids, nxt], 1), attention_mask=mask).logits[:, -1]
    assert len(cache.layers) == 6 and cache.get_seq_length() == 8
    assert (step - full).abs().max() <= 1e-5
    assert out.logits.shape == (3, 7, 97)


def manual_greedy(model, ids, mask, steps):
    """Argmax decoding by re-running the whole sequence (no cache): the reference."""
    for _ in range(steps):
        with torch.no_grad():
            nxt = model(ids, padding_mask=mask).logits[:, -1].argmax(-1, keepdim=True)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    return ids


@pytest.mark.parametrize("scheme", ["mesh", "residual+anchor"])
def test_greedy_generate_equals_manual_argmax_without_cache(scheme):
    model = build(tiny(scheme=scheme, spec="1+2R2+1"))
    hf = from_meshlm(model)
    ids, mask = left_padded_batch(97)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20,
                      do_sample=False)
    assert torch.equal(out, manual_greedy(model, ids, mask, 20))


def test_sampling_generate_with_and_without_cache_agree():
    hf = from_meshlm(build(tiny(spec="1+2R2+1")))
    ids, mask = left_padded_batch(97)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=True,
                  top_k=20,
                  top_p=0.9, temperature=0.8)
    torch.manual_seed(3)
    cached = hf.generate(ids, **kwargs)
    torch.manual_seed(3)
    uncached = hf.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert cached.shape == (3, 19) and int(cached.max()) < 97


def test_beam_search_with_and_without_cache_agree():
    hf = from_meshlm(build(tiny(spec="1+2R2+1")))
    ids = torch.randint(2, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(num_beams=3, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(hf.generate(ids, **kwargs), hf.generate(ids, use_cache=False, **kwargs))


def test_missing_or_truncated_weights_are_clear_errors(tmp_path):
    from meshlm.errors import CheckpointError
    from meshlm.hf import load_hf

    save_hf(build(tiny(vocab_size=VOCAB)), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot be loaded as a meshlm Hugging Face model"):
        load_hf(tmp_path)
    weights.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load_hf(tmp_path)


def test_exported_model_takes_depth_and_exit_settings():
    """config.loops / config.exit (or per-call loops=, exit=) reach the model, also through
    generate()."""
    from meshlm.generate import Sampling, generate
    from meshlm.model.exit import ExitRule

    model = build(tiny(spec="1+2R2+1", max_loops=4))
    hf = from_meshlm(model)
    ids, mask = left_padded_batch(97)
    with torch.no_grad():
        assert torch.equal(hf(ids, attention_mask=mask, loops=4, exit="state:inf").logits,
                           model(ids, padding_mask=mask, loops=1).logits)
    hf.config.loops, hf.config.exit = 4, "state:0.3"
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    ours = generate(model, prompts, Sampling(max_new_tokens=6, temperature=0, stop_at_eos=False),
                    pad_id=1,
                    loops=4, exit=ExitRule.parse("state:0.3"))  # the export parses its text
    assert out[:, ids.shape[1]:].tolist() == ours


def test_hidden_states_are_the_stage_boundaries_and_attention_weights_are_refused():
    model = build(tiny(spec="1+2R3+1"))
    hf = from_meshlm(model)
    ids, mask = left_padded_batch(97)
    with torch.no_grad():
        out = hf(ids, attention_mask=mask, output_hidden_states=True)
        stages = model(ids, padding_mask=mask, return_states=True).stages
        assert hf(ids, attention_mask=mask).hidden_states is None  # only when asked for
    expected = (stages.embeddings, stages.prelude, *stages.states[1:], stages.coda)
    assert (len(out.hidden_states) == 2 + 3 + 1
            and all(torch.equal(a, b) for a, b in zip(out.hidden_states, expected)))
    with pytest.raises(ValueError, match="returns no attention weights"):
        hf(ids, attention_mask=mask, output_attentions=True)


def test_model_card_states_the_sequence_length_a_default_seq_len_trained_at():
    from meshlm.hf.card import model_card

    cfg = tiny(context_length=48)
    # 0: the model's context length
    assert "sequence length 48)" in model_card(cfg, {"train": {"seq_len": 0}})
    assert "sequence length 32)" in model_card(cfg, {"train": {"seq_len": 32}})
