"""Weight-only quantization (meshlm.quant): round-trip bounds, batch-independent kernels,
calibration over every loop visit, exact decoding paths of the quantized model, and its checkpoint
verified and reopened like any other."""
import json

import pytest
import torch
from conftest import build, tiny

from meshlm.checkpoint import save_model, verify
from meshlm.errors import CheckpointError
from meshlm.generate import Sampling, generate
from meshlm.loading import open_model
from meshlm.quant import QuantizedLinear, quantize_model
from meshlm.quant.calibrate import targets
from meshlm.quant.linear import dequantize, quantize_weight

BITS = [8, 4]


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_is_within_half_a_step_per_layer(bits):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.05
    w[3, 7] = 1.0  # an outlier: its row's (int8) or group's (int4) step grows, the others' do not
    stored = quantize_weight(w, bits, 32)
    error = (dequantize(stored, 32) - w).abs()
    steps = stored["scales"].float()
    step = steps[:, None].expand_as(w) if bits == 8 else steps.repeat_interleave(32, 1)
    # round to nearest: half a step (bf16 scales: a hair over)
    assert (error <= step * 0.51 + 1e-7).all()
    assert error[4].max() < 0.05 * (0.5 / 127 if bits == 8 else 0.5) + 1e-3


@pytest.mark.parametrize("bits", BITS)
def test_the_kernel_multiplies_by_the_stored_weight_and_each_row_alone(bits):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    q = QuantizedLinear.from_linear(linear, bits, group_size=32)
    x = torch.randn(5, 64)
    y = q(x)
    reference = x @ q.weight_fp32().T + linear.bias
    # bf16 activations, fp32 accumulation
    assert (y - reference).abs().max() < 2e-2 * reference.abs().max()
    # a row's output ignores the batch
    assert torch.equal(torch.cat([q(x[i:i + 1]) for i in range(5)]), y)
    assert y.dtype == torch.float32 and q(x.bfloat16()).dtype == torch.bfloat16


def test_calibration_sees_every_loop_visit_of_a_shared_layer():
    model = build(tiny(spec="1+1R3+1", vocab_size=256))
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(4)]
    _, spec = quantize_model(model, 8, ("prelude", "cores", "coda"), batches=batches)
    visits = spec["calibration"]["visits"]
    assert visits and set(visits) == set(spec["layers"])
    for name, count in visits.items():
        # 3 loop passes per forward
        assert count == 4 * (3 if name.startswith("cores.") else 1), name
        assert spec["calibration"]["rows"][name] == count * 2 * 16


def test_calibration_picks_the_clip_with_the_smallest_output_error():
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    ids = torch.randint(0, 256, (2, 16))
    calibrated, _ = quantize_model(model, 4, ("cores",), group_size=32, batches=batches)
    plain, _ = quantize_model(model, 4, ("cores",), group_size=32)
    with torch.no_grad():
        states = [m(ids, return_states=True).stages.states[-1] for m in (model, calibrated, plain)]
    assert (states[1] - states[0]).norm() <= (states[2] - states[0]).norm() * 1.05


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("spec", ["1+1R4+1", "2R3"])
def test_quantized_decoding_is_exact_across_cache_and_speculation(bits, spec):
    model = build(tiny(spec=spec, vocab_size=512, d_model=64))
    quantized, _ = quantize_model(model, bits, ("prelude", "cores", "coda"), group_size=32)
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with torch.no_grad():
        cached = [generate(quantized, [p], s)[0] for p in prompts]
        assert [generate(quantized, [p], s, cache=False)[0] for p in prompts] == cached
        assert [generate(quantized, [p], s, speculate="2:3")[0] for p in prompts] == cached
        assert generate(quantized, prompts, s, pad_id=1) == cached  # batched (left-padded) == alone


def test_the_quantized_checkpoint_is_verified_and_reopens_bit_exactly(tmp_path):
    model = build(tiny(spec="1+1R3+1", vocab_size=256, tie_embeddings=False))
    quantized, spec = quantize_model(model, 4, ("cores", "head"), group_size=32)
    # all replaced
    assert "embed_out" in spec["layers"] and not targets(quantized, {"cores", "head"})
    meta = {"model": model.config.to_dict(), "step": 0, "quantization": spec}
    folder = save_model(quantized, tmp_path / "q", meta)
    assert verify(folder)["quantization"]["bits"] == 4
    reopened = open_model(folder).model
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(reopened(ids).logits, quantized(ids).logits)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["bits"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json"):
        open_model(folder)


@pytest.mark.parametrize("bits", BITS)
def test_a_quantized_checkpoint_exports_to_hf_and_back_bit_exactly(tmp_path, bits):
    from meshlm.errors import ConfigError
    from meshlm.hf import load_hf
    from meshlm.interop.convert import convert

    model = build(tiny(spec="1+1R2+1", vocab_size=256, tie_embeddings=False))
    quantized, spec = quantize_model(model, bits, ("cores", "head"), group_size=32)
    folder = save_model(quantized, tmp_path / "q", {"model": model.config.to_dict(),
                                                    "quantization": {**spec,
                                                                     "source": {"path": "runs/x"}}})
    with pytest.raises(ConfigError, match=rf"int{bits} .*--to hf.*\(runs/x\)"):
        convert(folder, tmp_path / "neox", to="neox")
    hf_folder = convert(folder, tmp_path / "hf")  # the default target of a quantized checkpoint
    config = json.loads((hf_folder / "config.json").read_text())
    assert config["meshlm_quantization"]["layers"] == spec["layers"]
    assert "quantization_config" not in config  # no transformers quantizer is asked for
    back = convert(hf_folder, tmp_path / "back")
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        reference = quantized(ids).logits
        exported = load_hf(hf_folder)
        assert exported.model.embed_out.qweight.dtype == quantized.embed_out.qweight.dtype
        assert exported.model.embed_out.scales.dtype == torch.bfloat16
        assert torch.equal(exported(ids).logits, reference)
        assert torch.equal(open_model(hf_folder).model(ids).logits, reference)
        assert torch.equal(open_model(back).model(ids).logits, reference)
    assert verify(back)["quantization"]["layers"] == spec["layers"]


def test_the_command_spells_the_parts_and_group_sizes_of_meshlm_quant():
    from meshlm import quant
    from meshlm.commands import quantize

    assert (quantize.PARTS, quantize.DEFAULT_PARTS, quantize.GROUP_SIZES) == \
        (quant.PARTS, quant.DEFAULT_PARTS, quant.GROUP_SIZES)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("speculate", [None, "2:2"])
def test_the_continuous_batcher_serves_a_quantized_model_as_it_decodes_alone(bits, speculate):
    from test_serve_batcher import reference, requests, staggered

    from meshlm.serve.batcher import Batcher

    model = build(tiny(spec="1+1R3+1", vocab_size=512, d_model=64))
    quantized, _ = quantize_model(model, bits, ("prelude", "cores", "coda"), group_size=32)
    rs = requests(speculate=speculate)
    with torch.no_grad():
        # rows join at token boundaries
        staggered(Batcher(quantized, eos_id=0, pad_id=1), rs, every=1)
        assert [r.tokens for r in rs] == [reference(quantized, r) for r in rs]
