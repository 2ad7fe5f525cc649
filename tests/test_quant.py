"""Quantization (meshlm.quant): round-trip bounds, batch-independent kernels (weight-only int8 and
int4, and int8 with int8-rounded activations), calibration over every loop visit, exact decoding
paths of the quantized model, and its checkpoint verified and reopened like any other."""
import json

import pytest
import torch
from conftest import build, tiny

from meshlm.checkpoint import save_model
from meshlm.errors import CheckpointError
from meshlm.folders.integrity import verify
from meshlm.generate import Sampling, generate
from meshlm.generate.speculative import Speculation
from meshlm.loading import open_model
from meshlm.quant import QuantizedLinear, quantize_model
from meshlm.quant import linear as linear_module
from meshlm.quant.calibrate import targets
from meshlm.quant.linear import dequantize, quantize_rows, quantize_weight

BITS = [8, 4]
# (bits, activations): weight-only int8 and int4, and int8 or int4 weights meeting int8 activations
KINDS = [pytest.param(8, "bf16", id="int8"), pytest.param(4, "bf16", id="int4"),
         pytest.param(8, "int8", id="w8a8"), pytest.param(4, "int8", id="w4a8")]


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


def test_activation_rows_round_within_half_a_step_of_their_own_scale():
    torch.manual_seed(0)
    x = torch.randn(4, 96)
    x[1] *= 1000  # a large row does not coarsen the others
    x[3] = 0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (4, 1)
    assert ((q.float() * scale - x).abs() <= scale * 0.5 * (1 + 1e-6)).all()
    assert torch.equal(scale[0], x[0].abs().max().reshape(1) / 127)
    assert not q[3].any()  # a zero row stays zero, no division by zero


@pytest.mark.parametrize("bits,activations", KINDS)
@pytest.mark.parametrize("ragged", [False, True])
def test_the_kernel_multiplies_by_the_stored_weight_and_each_row_alone(bits, activations, ragged):
    torch.manual_seed(0)
    # ragged: widths the CPU kernels do not take as they are (int8: in_features not a multiple of
    # 16; int4: out_features not a multiple of 16), padded for them
    shape = ((200 if bits == 8 else 224), 13) if ragged else (64, 96)
    linear = torch.nn.Linear(*shape)
    q = QuantizedLinear.from_linear(linear, bits, group_size=32, activations=activations)
    x = torch.randn(5, shape[0])
    y = q(x)
    reference = x @ q.weight_fp32().T + linear.bias
    # bf16 or int8 activations, fp32 (int32 for int8) accumulation
    assert (y - reference).abs().max() < 2e-2 * reference.abs().max()
    # a row's output ignores the batch
    assert torch.equal(torch.cat([q(x[i:i + 1]) for i in range(5)]), y)
    assert y.dtype == torch.float32 and q(x.bfloat16()).dtype == torch.bfloat16


def test_int8_activations_compute_the_exact_integer_product_then_scale():
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 72, bias=False)
    layer = QuantizedLinear.from_linear(linear, 8, activations="int8")
    x = torch.randn(3, 200) * torch.tensor([[1.0], [1e-3], [50.0]])
    a, row_scale = quantize_rows(x)
    sums = (a.double() @ layer.qweight.double().T).float()  # exact: every sum is an integer
    exact = (sums * row_scale) * layer.scales.float()
    y = layer(x)
    if linear_module.exact_int8_products():
        assert torch.equal(y, exact)
    else:  # a CPU without VNNI/AMX: the weight-only kernel's bf16 output (tested on its own below)
        assert ((y - exact).abs() <= 1e-2 * exact.abs().amax(1, keepdim=True)).all()
    # off CPU the same rounded activations meet the dequantized weight through F.linear
    difference = (layer._dequantized_product(x) - exact).abs().amax(1)
    assert (difference <= 1e-5 * exact.abs().amax(1)).all()  # fp32 rounding, per row
    assert "int8 activations" in repr(layer)
    with pytest.raises(ValueError, match="activations 'fp8': take bf16 or int8"):
        QuantizedLinear(64, 8, False, 4, 32, activations="fp8")


def test_int8_weights_take_int8_activations_unless_asked_for_weight_only():
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    for bits, activations, expected in [(8, None, "int8"), (8, "bf16", "bf16"), (4, None, "bf16")]:
        quantized, spec = quantize_model(model, bits, ("cores",), group_size=32,
                                         activations=activations)
        assert spec["activations"] == expected
        assert {m.activations for m in quantized.modules()
                if isinstance(m, QuantizedLinear)} == {expected}


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


def test_int8_activations_without_exact_int8_products_take_the_weight_only_kernel(monkeypatch):
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(torch.nn.Linear(200, 40), 8, activations="int8")  # ragged
    x = torch.randn(4, 200)
    reference = layer._dequantized_product(x)  # the same rounded activations, in fp32
    monkeypatch.setattr(linear_module, "exact_int8_products", lambda: False)
    y = layer(x)
    # bf16 output of the weight-only kernel: within its rounding of the fp32 product
    assert ((y - reference).abs() <= 1e-2 * reference.abs().amax(1, keepdim=True)).all()
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(4)]), y)  # each row alone


@pytest.mark.parametrize("bits,activations", KINDS)
@pytest.mark.parametrize("spec", ["1+1R4+1", "2R3"])
def test_quantized_decoding_is_exact_across_cache_and_speculation(bits, activations, spec):
    model = build(tiny(spec=spec, vocab_size=512, d_model=64))
    quantized, _ = quantize_model(model, bits, ("prelude", "cores", "coda"), group_size=32,
                                  activations=activations)
    assert_decodes_exactly(quantized)


def test_int8_activations_decode_exactly_through_the_weight_only_fallback(monkeypatch):
    monkeypatch.setattr(linear_module, "exact_int8_products", lambda: False)  # a CPU without VNNI
    model = build(tiny(spec="1+1R4+1", vocab_size=512, d_model=64))
    assert_decodes_exactly(quantize_model(model, 8, ("prelude", "cores", "coda"),
                                          activations="int8")[0])


@pytest.mark.parametrize("bits,activations,words", [
    (8, "bf16", "4 linear layers int8 weight-only"),
    (4, "bf16", "4 linear layers int4 in groups of 32"),
    (8, "int8", "4 linear layers int8 with int8 activations"),
    (4, "int8", "4 linear layers int4 in groups of 32 with int8 activations")])
def test_decoding_names_the_quantized_layers(bits, activations, words):
    from meshlm.decoding import for_decoding

    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    quantized, _ = quantize_model(model, bits, ("cores",), group_size=32, activations=activations)
    line = for_decoding("auto", quantized)[1].describe()
    assert f"; {words}" in line and line.endswith(")")


def assert_decodes_exactly(quantized) -> None:
    """Greedy tokens cached == uncached == under speculation == batched (left-padded)."""
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with torch.no_grad():
        cached = [generate(quantized, [p], s)[0] for p in prompts]
        assert [generate(quantized, [p], s, cache=False)[0] for p in prompts] == cached
        assert [generate(quantized, [p], s, speculate=Speculation(2, 3))[0]
                for p in prompts] == cached
        assert generate(quantized, prompts, s, pad_id=1) == cached  # batched (left-padded) == alone


@pytest.mark.parametrize("bits,activations", [(4, "bf16"), (8, "int8")])
def test_the_quantized_checkpoint_is_verified_and_reopens_bit_exactly(tmp_path, bits,
                                                                      activations):
    model = build(tiny(spec="1+1R3+1", vocab_size=256, tie_embeddings=False))
    quantized, spec = quantize_model(model, bits, ("cores", "head"), group_size=32,
                                     activations=activations)
    # all replaced
    assert "embed_out" in spec["layers"] and not targets(quantized, {"cores", "head"})
    meta = {"model": model.config.to_dict(), "step": 0, "quantization": spec}
    folder = save_model(quantized, tmp_path / "q", meta)
    assert verify(folder)["quantization"]["activations"] == activations
    reopened = open_model(folder).model
    assert reopened.embed_out.activations == activations
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(reopened(ids).logits, quantized(ids).logits)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["bits"] = 12 - bits
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json"):
        open_model(folder)


def test_a_checkpoint_quantized_before_int8_activations_opens_weight_only(tmp_path):
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    quantized, spec = quantize_model(model, 8, ("cores",))
    del spec["activations"]  # as meshlm wrote it before the key existed
    folder = save_model(quantized, tmp_path / "q", {"model": model.config.to_dict(),
                                                    "quantization": spec})
    reopened = open_model(folder).model
    assert {m.activations for m in reopened.modules() if isinstance(m, QuantizedLinear)} == {"bf16"}


@pytest.mark.parametrize("bits,activations", KINDS)
def test_a_quantized_checkpoint_exports_to_hf_and_back_bit_exactly(tmp_path, bits, activations):
    from meshlm.errors import ConfigError
    from meshlm.hf import load_hf
    from meshlm.interop.convert import convert

    model = build(tiny(spec="1+1R2+1", vocab_size=256, tie_embeddings=False))
    quantized, spec = quantize_model(model, bits, ("cores", "head"), group_size=32,
                                     activations=activations)
    folder = save_model(quantized, tmp_path / "q", {"model": model.config.to_dict(),
                                                    "quantization": {**spec,
                                                                     "source": {"path": "runs/x"}}})
    with pytest.raises(ConfigError, match=rf"int{bits} .*--to hf.*\(runs/x\)"):
        convert(folder, tmp_path / "neox", to="neox")
    hf_folder = convert(folder, tmp_path / "hf")  # the default target of a quantized checkpoint
    config = json.loads((hf_folder / "config.json").read_text())
    assert config["meshlm_quantization"]["layers"] == spec["layers"]
    assert config["meshlm_quantization"]["activations"] == activations
    assert "quantization_config" not in config  # no transformers quantizer is asked for
    back = convert(hf_folder, tmp_path / "back")
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        reference = quantized(ids).logits
        exported = load_hf(hf_folder)
        assert exported.model.embed_out.qweight.dtype == quantized.embed_out.qweight.dtype
        assert exported.model.embed_out.scales.dtype == torch.bfloat16
        assert exported.model.embed_out.activations == activations
        assert torch.equal(exported(ids).logits, reference)
        assert torch.equal(open_model(hf_folder).model(ids).logits, reference)
        assert torch.equal(open_model(back).model(ids).logits, reference)
    assert verify(back)["quantization"]["layers"] == spec["layers"]


def test_the_command_spells_the_parts_and_group_sizes_of_meshlm_quant():
    from meshlm import quant
    from meshlm.commands import quantize

    assert (quantize.PARTS, quantize.DEFAULT_PARTS, quantize.GROUP_SIZES, quantize.ACTIVATIONS) == \
        (quant.PARTS, quant.DEFAULT_PARTS, quant.GROUP_SIZES, quant.ACTIVATIONS)


@pytest.mark.parametrize("bits,activations", KINDS)
@pytest.mark.parametrize("speculate", [None, Speculation(2, 2)])
def test_the_continuous_batcher_serves_a_quantized_model_as_it_decodes_alone(bits, activations,
                                                                           speculate):
    from test_serve_batcher import reference, requests, staggered

    from meshlm.serve.batcher import Batcher

    model = build(tiny(spec="1+1R3+1", vocab_size=512, d_model=64))
    quantized, _ = quantize_model(model, bits, ("prelude", "cores", "coda"), group_size=32,
                                  activations=activations)
    rs = requests(speculate=speculate)
    with torch.no_grad():
        # rows join at token boundaries
        staggered(Batcher(quantized, eos_id=0, pad_id=1), rs, every=1)
        assert [r.tokens for r in rs] == [reference(quantized, r) for r in rs]
