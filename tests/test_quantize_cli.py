"""`meshlm quantize` end to end, each command in a fresh subprocess with a clean environment: the
written checkpoint is verified, opened by `meshlm generate` (greedy == under speculation) and
`meshlm eval`."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import build, tiny
from servekit import ROOT, clean_env

from meshlm import decoding
from meshlm.checkpoint import save_model
from meshlm.folders.integrity import verify
from meshlm.kernels import kernel


def meshlm(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshlm.cli", *args], env=env, cwd=ROOT,
                          capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
# (bits, --activations or None for the default, what it stores, the default output folder)
@pytest.mark.parametrize("bits,flag,activations,name", [(8, "bf16", "bf16", "int8"),
                                                        (4, None, "bf16", "int4"),
                                                        (8, None, "int8", "w8a8"),
                                                        (4, "int8", "int8", "w4a8")])
def test_quantize_then_generate_and_eval_in_fresh_processes(tmp_path, bits, flag, activations,
                                                            name):
    torch.manual_seed(0)
    source = save_model(build(tiny(spec="1+1R3+1", vocab_size=8192, context_length=64, d_model=64)),
                        tmp_path / "m")
    env = {**clean_env(), "MESHLM_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    done = meshlm("quantize", str(source), "--bits", str(bits),
                  *(["--activations", flag] if flag else []),
                  "--group-size", "32", "--parts", "cores,coda",
                  "--seq-len", "32", "--calibration", "4", "--report-windows", "4", env=env)
    assert done.returncode == 0, done.stderr
    assert "(trained)" in done.stdout and "state distance" in done.stdout  # the per-loop report
    folder = source / name  # the default output folder
    entry = verify(folder)["quantization"]  # hashes like any checkpoint
    assert entry["bits"] == bits and len(entry["report"]["states"]) == 4  # h⁰ … h³
    assert entry["activations"] == activations
    assert all(entry["calibration"]["visits"][n] == (3 if n.startswith("cores.") else 1)
               for n in entry["layers"])
    texts = []
    for extra in ([], ["--speculate", "2:3"]):
        done = meshlm("generate", str(folder), "To be, or not", "-t", "0", "-n", "12", *extra,
                      env=env)
        assert done.returncode == 0, done.stderr
        texts.append(done.stdout)
    assert texts[0] == texts[1]  # speculation exact with respect to the quantized model
    took = decoding.ROW_KERNEL_NOTE in done.stderr or decoding.ROWS_KERNEL_NOTE in done.stderr
    assert took == row_kernel_paid(tmp_path / "cache")
    done = meshlm("eval", str(folder), "--tasks", "none", "--loops", "2,3", "--limit", "8", "--out",
                  str(tmp_path / "e.json"), env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "e.json").read_text())
    exported_without_meshlm(folder, tmp_path, env, activations)


def row_kernel_paid(cache) -> bool:
    """Whether this run's probe found meshlm's compiled one-row int8 kernel faster than
    torch._int_mm (no probe: no int8 activations, no compiler, or a CPU whose _int_mm is not
    exact)."""
    path = cache / "machine.json"
    probes = json.loads(path.read_text()) if path.exists() else {}
    return any(key.startswith("int8-row-kernel")
               and entry["value"]["kernel_over_torch"] >= kernel.MIN_SPEEDUP
               for key, entry in probes.items())


def exported_without_meshlm(folder, tmp_path, env, activations: str) -> None:
    """`meshlm convert` writes the quantized checkpoint as a Hugging Face folder whose own code, in
    a process where meshlm cannot be imported, gives the quantized model's logits bit for bit and
    the same greedy tokens cached, uncached and under speculation, also after saving it again."""
    from cleanenv import run_without_meshlm

    from meshlm.loading import open_model

    done = meshlm("convert", str(folder), str(tmp_path / "hf"), env=env)  # default: --to hf
    assert done.returncode == 0, done.stderr
    model = open_model(folder).model
    ids = torch.randint(0, 8192, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    reference = tmp_path / "ref.pt"
    torch.save({"ids": ids, "logits": logits}, reference)
    run_without_meshlm(f"""
import torch
from transformers import AutoModelForCausalLM
ref = torch.load({str(reference)!r})
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r},
                                             trust_remote_code=True).eval()
assert {{m.activations for m in model.modules()
        if type(m).__name__ == "QuantizedLinear"}} == {{{activations!r}}}
with torch.no_grad():
    assert torch.equal(model(ref["ids"]).logits, ref["logits"])
    cached = model.generate(ref["ids"][:1], max_new_tokens=8, do_sample=False)
    uncached = model.generate(ref["ids"][:1], max_new_tokens=8, do_sample=False, use_cache=False)
    spec = model.generate(ref["ids"][:1], max_new_tokens=8, do_sample=False, speculate="2:3")
assert torch.equal(cached, uncached) and torch.equal(cached, spec)
model.save_pretrained({str(tmp_path / "again")!r})
again = AutoModelForCausalLM.from_pretrained({str(tmp_path / "again")!r},
                                             trust_remote_code=True).eval()
with torch.no_grad():
    assert torch.equal(again(ref["ids"]).logits, ref["logits"])
""", tmp_path)


def test_quantizing_a_quantized_checkpoint_names_its_source(tmp_path, capsys):
    from meshlm.cli import main

    source = save_model(build(tiny(spec="1+1R2+1", vocab_size=8192, context_length=64)),
                        tmp_path / "m")
    assert (main(["quantize", str(source), "--bits", "8", "--seq-len", "16", "--calibration", "2",
                  "--no-report"]) == 0)
    # --bits 8 takes int8 activations by default, and the folder says so
    assert verify(source / "w8a8")["quantization"]["activations"] == "int8"
    assert "int8 weights and int8 activations" in capsys.readouterr().out
    assert main(["quantize", str(source / "w8a8"), "--bits", "4", "--no-report"]) != 0
    assert f"pass the full-precision checkpoint it came from ({source}" in capsys.readouterr().err
    assert main(["quantize", str(source), "--bits", "8", "--parts", "cores,bogus"]) != 0
