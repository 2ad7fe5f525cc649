"""GPT-NeoX <-> meshlm conversion (exact), meshlm -> HF folders, retrofit, and clear errors for bad
input."""
import json

import pytest
import torch
from conftest import build, tiny
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from meshlm.backbones import BACKBONES
from meshlm.checkpoint import save_model
from meshlm.cli import main
from meshlm.config import ModelConfig
from meshlm.errors import CheckpointError, ConfigError
from meshlm.interop.convert import convert
from meshlm.interop.families import hf_config_kwargs
from meshlm.interop.retrofit import plan, retrofit
from meshlm.loading import open_model, read_family
from meshlm.model import MeshLM

NEOX = ModelConfig(spec="4", d_model=32, n_heads=4, vocab_size=211, context_length=64,
                   scheme="vanilla",
                   scale_embeddings=False, rotary_pct=0.5, rotary_base=500.0)


@pytest.fixture(scope="module")
def pythia(tmp_path_factory):
    """A small random GPTNeoXForCausalLM saved the transformers way, plus its reference logits."""
    folder = tmp_path_factory.mktemp("neox") / "pythia-tiny"
    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(**hf_config_kwargs(NEOX, BACKBONES["neox"]))).eval()
    hf.save_pretrained(folder)
    x = torch.randint(0, NEOX.vocab_size, (2, 13))
    with torch.no_grad():
        logits = hf(x).logits
    return folder, hf, x, logits


def logits_of(model, x):
    with torch.no_grad():
        return model(x).logits


def test_neox_folder_converts_with_equal_logits(pythia, tmp_path):
    folder, _, x, expected = pythia
    out = convert(folder, tmp_path / "ckpt")
    model = open_model(out).model
    assert model.config.scheme == "vanilla" and model.config.rotary_base == 500.0
    assert (logits_of(model, x) - expected).abs().max() <= 1e-5


def test_neox_meshlm_neox_round_trip_is_exact(pythia, tmp_path):
    folder, hf, x, expected = pythia
    convert(folder, tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "back", to="neox")
    back = GPTNeoXForCausalLM.from_pretrained(tmp_path / "back").eval()
    reference = hf.state_dict()
    assert all(torch.equal(back.state_dict()[k], reference[k]) for k in reference)
    assert torch.equal(logits_of(back, x), expected)
    # the source carries no tokenizer and its 211 ids are not the default's 8,192: none is made up
    assert (not (tmp_path / "ckpt" / "tokenizer.json").exists()
            and not (tmp_path / "back" / "tokenizer.json").exists())


def test_scaled_embeddings_fold_into_gpt_neox(tmp_path):
    model = build(tiny(spec="3", scheme="vanilla", scale_embeddings=True, vocab_size=211))
    save_model(model, tmp_path / "ckpt")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "neox")]) == 0
    hf = GPTNeoXForCausalLM.from_pretrained(tmp_path / "neox").eval()
    x = torch.randint(0, 211, (2, 9))
    assert (logits_of(hf, x) - logits_of(model, x)).abs().max() <= 1e-5


def test_meshlm_to_hf_and_back_is_exact(tmp_path):
    model = build(tiny(spec="1+2R2+1", scheme="mesh", vocab_size=8192))
    save_model(model, tmp_path / "ckpt")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "again")]) == 0
    x = torch.randint(0, 8192, (2, 9))
    assert torch.equal(logits_of(open_model(tmp_path / "again").model, x), logits_of(model, x))


def test_a_chat_template_travels_with_every_conversion(tmp_path):
    """A fine-tuned model's template (chat_template.jinja, meshlm.data.tokenizer.TEMPLATE_FILE)
    goes into each format's folder, where transformers' tokenizer and meshlm serve find it."""
    from transformers import AutoTokenizer

    from meshlm.data.tokenizer import TEMPLATE_FILE

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    save_model(build(tiny(spec="2", scheme="vanilla", vocab_size=8192)), tmp_path / "ckpt")
    (tmp_path / "ckpt" / TEMPLATE_FILE).write_text(template)
    for source, to in (("ckpt", "neox"), ("ckpt", "hf"), ("neox", "meshlm")):  # and back
        assert main(["convert", str(tmp_path / source), str(tmp_path / to), "--to", to]) == 0
        assert (tmp_path / to / TEMPLATE_FILE).read_text() == template, to
    chat = [{"role": "user", "content": "hi"}]
    for to in ("neox", "hf"):
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / to)
        assert tokenizer.apply_chat_template(chat, tokenize=False) == "[user] hi\n", to


# -- retrofit --------------------------------------------------------------------------------------
def test_retrofit_plan_blocks():
    p = plan(24, "4+8R2+4")
    assert p.prelude == [0, 1, 2, 3] and p.coda == [20, 21, 22, 23]
    assert p.cores == [[list(range(4, 12)), list(range(12, 20))]]
    assert plan(24, "4+4R2+4").cores[0] == [list(range(4 + 4 * b, 8 + 4 * b)) for b in range(4)]
    assert plan(6, "1+2+2+1").cores == [[[1, 2]], [[3, 4]]]


def test_retrofit_with_one_pass_reproduces_the_source(pythia):
    folder, _, x, expected = pythia
    cfg, state = read_family(folder)
    model, _ = retrofit(cfg, state, "1+2R1+1", scheme="base", core_init="block")
    assert (logits_of(model, x) - expected).abs().max() <= 1e-5


def test_retrofit_core_inits(pythia):
    cfg, state = read_family(pythia[0])
    key = "attention.query_key_value.weight"
    block, _ = retrofit(cfg, state, "1+1R2+1", scheme="base", core_init="block", block_index=-1)
    assert torch.equal(block.state_dict()[f"cores.0.0.{key}"], state[f"cores.0.2.{key}"])
    avg, _ = retrofit(cfg, state, "1+1R2+1", scheme="mesh", core_init="average")
    mean = (state[f"cores.0.1.{key}"] + state[f"cores.0.2.{key}"]) / 2
    torch.testing.assert_close(avg.state_dict()[f"cores.0.0.{key}"], mean)
    assert torch.equal(avg.state_dict()["coda.0.mlp.dense_4h_to_h.weight"],
                       state["cores.0.3.mlp.dense_4h_to_h.weight"])


def test_retrofit_mesh_router_start_base_routes_each_step_to_its_own_slot(pythia):
    cfg, state = read_family(pythia[0])
    model, _ = retrofit(cfg, state, "1+1R2+1", scheme="mesh", router_start="base")
    with torch.no_grad():
        routing = model(pythia[2], return_states=True).stages.routing
    for pair, (write, read) in enumerate(routing):
        assert (write.argmax(-1) == pair + 1).all() and (read[..., pair + 1] > 0.98).all()


def test_cli_retrofit_writes_a_trainable_checkpoint(pythia, tmp_path):
    assert main(["retrofit", str(pythia[0]), str(tmp_path / "mesh"), "--spec", "1+1R2+1"]) == 0
    model = open_model(tmp_path / "mesh").model
    assert model.config.scheme == "mesh" and model.config.spec == "1+1R2+1"
    meta = json.loads((tmp_path / "mesh" / "config.json").read_text())
    assert meta["retrofit"]["layers"]["cores"] == [[[1], [2]]] and meta["step"] == 0


# -- bad input -------------------------------------------------------------------------------------
def test_bad_inputs_are_clear_errors(pythia, tmp_path):
    folder = pythia[0]
    not_neox = tmp_path / "bert"
    not_neox.mkdir()
    (not_neox / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="model_type 'bert', not a GPT-NeoX"):
        convert(not_neox, tmp_path / "o1")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        convert(empty, tmp_path / "o2")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="has no weights"):
        convert(no_weights, tmp_path / "o3")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((folder / "config.json").read_text())
    data = (folder / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        convert(truncated, tmp_path / "o4")
    cfg, state = read_family(folder)
    with pytest.raises(ConfigError, match="does not fit the 4-layer source"):
        retrofit(cfg, state, "2+2R2+2")
    mesh = build(tiny())
    save_model(mesh, tmp_path / "mesh")
    with pytest.raises(ConfigError, match="only a vanilla model converts to GPT-NeoX"):
        convert(tmp_path / "mesh", tmp_path / "o5", to="neox")


@pytest.mark.parametrize("args, message", [
    (["convert", "{tmp}/nowhere", "{tmp}/out"], "does not exist"),
    (["retrofit", "{neox}", "{tmp}/out", "--spec", "3+2R2+3"], "does not fit the 4-layer source"),
    (["convert", "{neox}", "{neox}"], "is the source"),
])
def test_cli_errors_exit_2_with_one_line(pythia, tmp_path, args, message, capsys):
    assert main([a.format(tmp=tmp_path, neox=pythia[0]) for a in args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_unsupported_gpt_neox_variant_is_named(pythia, tmp_path):
    folder = tmp_path / "variant"
    folder.mkdir()
    raw = json.loads((pythia[0] / "config.json").read_text())
    raw.update(hidden_act="gelu_fast", use_parallel_residual=False)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="hidden_act='gelu_fast'.*use_parallel_residual=false"):
        read_family(folder)


def test_meshlm_state_names_survive(pythia):
    cfg, state = read_family(pythia[0])
    MeshLM(cfg).load_state_dict(state, strict=True)
