"""Native generation: cached greedy decoding equals an uncached argmax loop; sampling filters; the
CLI."""
import pytest
import torch
from conftest import build, tiny

from meshlm.checkpoint import save_model
from meshlm.cli import main
from meshlm.errors import ConfigError
from meshlm.generate import Sampling, generate, next_token
from meshlm.hf import save_hf
from meshlm.loading import open_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]


def manual_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    for _ in range(steps):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("scheme", ["mesh", "anchor", "vanilla"])
def test_batched_cached_greedy_equals_uncached_argmax_per_prompt(scheme):
    model = build(tiny(scheme=scheme, spec="1+2+1+1" if scheme == "vanilla" else "1+2R2+1"))
    s = Sampling(max_new_tokens=20, temperature=0, stop_at_eos=False)
    out = generate(model, PROMPTS, s)
    assert out == [manual_greedy(model, p, 20) for p in PROMPTS]
    assert generate(model, PROMPTS, s, cache=False) == out


def test_stops_at_eos_and_pads_finished_rows():
    model = build(tiny())
    with torch.no_grad():
        model.final_layer_norm.weight.zero_()
        model.final_layer_norm.bias.fill_(1.0)  # the head always sees a vector of ones …
        model.embed_out.weight.zero_()
        model.embed_out.weight[0] = 1.0  # … so token 0 (EOS) always wins
    out = generate(model, PROMPTS, Sampling(max_new_tokens=5, temperature=0))
    assert out == [[0], [0], [0]]


def test_sampling_is_reproducible_and_filters():
    model = build(tiny())
    s = Sampling(max_new_tokens=8, temperature=1.0, top_k=5, seed=7, stop_at_eos=False)
    assert generate(model, PROMPTS, s) == generate(model, PROMPTS, s)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).repeat(200, 1)
    top2 = next_token(logits, Sampling(top_k=2), torch.Generator().manual_seed(0))
    assert set(top2.tolist()) == {1, 2}
    nucleus = next_token(logits, Sampling(top_p=0.5), torch.Generator().manual_seed(0))
    assert set(nucleus.tolist()) == {1}  # token 1 alone holds > 50% of the mass
    greedy = next_token(logits, Sampling(temperature=0))
    assert set(greedy.tolist()) == {1}


@pytest.mark.parametrize("settings", [{"temperature": 5e-324}, {"temperature": 1e-30},
                                      {"top_p": 5e-324}, {"top_p": 1e-45, "top_k": 1}])
def test_the_tiniest_valid_temperature_and_top_p_draw_the_argmax(settings):
    """Values a JSON body may carry: 1 / 5e-324 overflows to inf, and 5e-324 is 0 in fp32."""
    logits = torch.randn(3, 50) * 10
    s = Sampling(seed=0, **{"temperature": 1.0, **settings})
    tokens = next_token(logits, s, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))


def test_bad_sampling_settings_are_one_clear_error():
    with pytest.raises(ConfigError, match="temperature=-1.*top_p=0"):
        Sampling(temperature=-1, top_p=0)
    model = build(tiny(context_length=10))
    with pytest.raises(ConfigError, match="pass -n 3 or less"):
        generate(model, PROMPTS, Sampling(max_new_tokens=4))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny MeSH model as a meshlm checkpoint and as a Hugging Face folder (shipped 8192
    tokenizer)."""
    root = tmp_path_factory.mktemp("gen")
    model = build(tiny(vocab_size=8192, context_length=48))
    save_model(model, root / "ckpt")
    save_hf(model, root / "hf")
    return root


@pytest.mark.parametrize("kind", ["ckpt", "hf"])
def test_cli_generate_streams_a_continuation(checkpoints, kind, capsys):
    args = ["generate", str(checkpoints / kind), "Once upon a time", "-n", "12", "--seed", "1",
            "--top-k", "40"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("Once upon a time") and len(first) > len("Once upon a time\n")
    assert main(args) == 0
    assert capsys.readouterr().out == first  # same seed, same text


def test_cli_generate_greedy_batch_matches_library(checkpoints, capsys):
    texts = ["To be", "or not"]
    assert (main(["generate", str(checkpoints / "ckpt"), *texts, "-t", "0", "-n", "5",
                  "--ignore-eos"]) == 0)
    printed = capsys.readouterr().out
    opened = open_model(checkpoints / "ckpt")
    model, tok = opened.model, opened.tokenizer
    new = generate(model, [tok.encode(t) for t in texts],
                   Sampling(max_new_tokens=5, temperature=0, stop_at_eos=False),
                   eos_id=tok.eos_id, pad_id=tok.pad_id)
    assert all(len(row) == 5 for row in new)
    expected = "".join(f"{text}{tok.decode(t for t in row if t != tok.eos_id)}\n{'-' * 40}\n"
                       for text, row in zip(texts, new))
    assert printed == expected


@pytest.mark.parametrize("args, message", [
    (["{ckpt}", "hello", "-n", "100"], "exceeds context_length=48"),
    (["{tmp}/missing", "hello"], "is not a folder"),
    (["{ckpt}", "hello", "--top-p", "1.5"], "top_p=1.5 must be in (0, 1]"),
])
def test_cli_generate_errors_exit_2(checkpoints, tmp_path, args, message, capsys):
    args = [a.format(ckpt=checkpoints / "ckpt", tmp=tmp_path) for a in args]
    assert main(["generate", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith("meshlm generate: error:")
            and message in lines[0]), lines


def test_cli_generate_with_depth_and_exit(checkpoints, capsys):
    assert (main(["generate", str(checkpoints / "ckpt"), "To be", "-t", "0", "-n", "5", "--loops",
                  "3",
                  "--exit", "state:0.1"]) == 0)
    assert capsys.readouterr().out.startswith("To be")
    assert main(["generate", str(checkpoints / "ckpt"), "To be", "--exit", "halt:1"]) == 2
    assert "exit criterion 'halt' is unknown; use one of: state, kl" in capsys.readouterr().err
