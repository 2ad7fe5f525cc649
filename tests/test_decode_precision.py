"""Decoding's precision policy with the bf16 run policy forced (so this runs the same on CPUs
without bf16): `--dtype auto` decodes in fp32, where speculation and batching give exactly plain
greedy's tokens."""
import pytest
import torch
from conftest import build, tiny
from test_runtime import fake_cpu

from meshlm.checkpoint import save_model
from meshlm.cli import main
from meshlm.decoding import for_decoding
from meshlm.generate import Sampling, generate
from meshlm.generate.speculative import Speculation
from meshlm.runtime import precision
from meshlm.serve.batcher import Batcher, Request

CPU = torch.device("cpu")


@pytest.fixture
def bf16_machine(monkeypatch, tmp_path):
    """A CPU the run policy picks bf16 autocast on: native bf16 flag, probe 7x fp32."""
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    fake_cpu(monkeypatch, flags=("avx512_bf16",), bf16_gflops=700.0)
    assert precision.choose("auto", CPU).dtype == torch.bfloat16


def test_auto_decodes_in_fp32_where_the_run_policy_picks_bf16(bf16_machine):
    model = build(tiny())
    device, chosen = for_decoding("auto", model)
    assert chosen.dtype is None and chosen.reason.startswith(precision.DECODING_FP32)
    assert for_decoding("bf16", model)[1].dtype == torch.bfloat16  # asked for: honoured
    assert precision.for_model("auto", model)[1].dtype == torch.bfloat16  # eval and probe keep bf16


def test_generate_and_the_batcher_under_the_decoding_policy_are_exact(bf16_machine, tmp_path,
                                                                      capsys):
    model = build(tiny(spec="1+1R4+1", vocab_size=8192, context_length=64))
    save_model(model, tmp_path / "ckpt")
    outputs = []
    for extra in ([], ["--speculate", "2:3"]):
        assert (main(["generate", str(tmp_path / "ckpt"), "To be, or not", "-t", "0", "-n", "16",
                      *extra]) == 0)
        captured = capsys.readouterr()
        assert f"generated in fp32 ({precision.DECODING_FP32}" in captured.err
        outputs.append(captured.out)
    assert outputs[0] == outputs[1]  # lossless on the default path

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    device, chosen = for_decoding("auto", model)
    with precision.autocast(device, chosen), torch.no_grad():
        alone = [generate(model, [p], s)[0] for p in prompts]
        batcher = Batcher(model, eos_id=0, pad_id=1)
        requests = [Request(p, s, speculate=spec) for p in prompts
                    for spec in (None, Speculation())]
        for r in requests:
            batcher.submit(r)
        while batcher.step():
            pass
    assert [r.tokens for r in requests] == [a for a in alone for _ in range(2)]
