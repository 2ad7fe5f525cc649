"""MeSH against a direct transcription of the paper's equations, plus gradcheck and router facts."""
import pytest
import torch
import torch.nn.functional as F
from conftest import build, tiny

from meshlm.model import MeshLM


def transcribed_mesh_logits(model: MeshLM, x: torch.Tensor) -> torch.Tensor:
    """MeSH exactly as the paper writes it, with an explicit list of B slot tensors and separate
    write/read routers Linear(d, B) (the model fuses each pair into one Linear(d, 2B))."""
    cfg = model.config
    B = model.scheme.slots
    t = x.shape[1]
    pos = torch.arange(t).expand_as(x)
    rope = model.rotary(pos, model.embed_in.weight.dtype)

    def routers(pair):
        r = model.scheme.routers[pair]
        w_write, w_read = r.weight[:B], r.weight[B:]
        b_write, b_read = r.bias[:B], r.bias[B:]
        return (lambda q: F.softmax(q @ w_write.T + b_write,
                                    -1)), (lambda q: F.softmax(q @ w_read.T + b_read, -1))

    def write_read(pair, query, value, slots):
        write, read = routers(pair)
        w, r = write(query), read(query)  # (B, T, slots)
        for b in range(B):  # m_b += w_b · value, for every slot b (slot 0 included)
            slots[b] = slots[b] + w[..., b:b + 1] * value
        return sum(r[..., b:b + 1] * slots[b] for b in range(B))  # read from the updated buffer

    e = model.embed_in(x) * cfg.d_model ** 0.5
    slots = [e] + [torch.zeros_like(e) for _ in range(B - 1)]
    p = model.prelude(e, rope, None)
    h = write_read(0, p, p, slots)  # transitional write/read, query p
    for t_step, core_index in enumerate(cfg.layout.schedule):
        u = model.cores[core_index](h, rope, None)
        h = write_read(t_step + 1, h, u, slots)  # pair t+1, query h^t
    y = model.coda(h, rope, None)
    return model.embed_out(model.final_layer_norm(y))


def randomise_routers(model, std=0.5):
    """Make routing far from uniform so the test sees real routing, not near-averages."""
    with torch.no_grad():
        for r in model.scheme.routers:
            r.weight.normal_(0, std)
            r.bias.normal_(0, 1.0)


@pytest.mark.parametrize("spec, slots", [("1+1R2+1", None), ("1+2R3+1", None), ("2+1+1+1", None),
                                         ("1+1R2+1", 2), ("0+2R2+0", 7)])
def test_mesh_equals_the_transcribed_equations(spec, slots):
    opts = {} if slots is None else {"slots": slots}
    model = build(tiny(spec=spec, scheme_options=opts))
    randomise_routers(model)
    x = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, transcribed_mesh_logits(model, x), rtol=0,
                                   atol=1e-5)


def test_training_path_equals_the_transcribed_equations_and_their_gradients():
    """Under autograd the routers' softmax runs slots-major and a read mixes by a product and a
    sum (meshlm.model.memory): the same logits and the same gradients as the paper's equations."""
    model = build(tiny(spec="1+1R3+1"))
    randomise_routers(model)
    x = torch.randint(0, model.config.vocab_size, (3, 9))
    grads = []
    for forward in (lambda: model(x).logits, lambda: transcribed_mesh_logits(model, x)):
        model.zero_grad()
        logits = forward()
        assert logits.requires_grad
        (logits.square().mean() + logits[:, :, 0].sum()).backward()
        grads.append((logits.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}))
    (ours, ours_grads), (paper, paper_grads) = grads
    torch.testing.assert_close(ours, paper, rtol=0, atol=1e-5)
    assert ours_grads.keys() == paper_grads.keys()
    for name in ours_grads:
        torch.testing.assert_close(ours_grads[name], paper_grads[name], rtol=1e-4, atol=1e-5,
                                   msg=name)


def test_slot_count_defaults_to_k_plus_3_and_router_count_to_cap_plus_1():
    for spec, k in [("1+1R2+1", 2), ("1+1R3+1", 3), ("1+1+1+1+1", 3)]:
        model = build(tiny(spec=spec))
        assert model.scheme.slots == k + 3
        assert len(model.scheme.routers) == k + 1


def test_gradcheck_float64():
    model = build(tiny(spec="1+1R2+1", d_model=16, n_heads=2, vocab_size=13), dtype=torch.float64)
    randomise_routers(model)
    x = torch.randint(0, 13, (2, 5))
    names = ["scheme.routers.0.weight", "scheme.routers.2.bias", "cores.0.0.mlp.dense_4h_to_h.bias",
             "embed_in.weight"]
    params = dict(model.named_parameters())

    def loss(*tensors):
        out = torch.func.functional_call(model, dict(zip(names, tensors)), (x,),
                                         {"targets": torch.roll(x, -1, 1)})
        return out.loss

    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6)


def test_routers_start_near_uniform():
    model = build(tiny())
    out = model(torch.randint(0, 97, (2, 8)), return_states=True)
    for w, r in out.stages.routing:
        assert (w - 1 / model.scheme.slots).abs().max() < 0.05
        assert (r - 1 / model.scheme.slots).abs().max() < 0.05


def test_closed_form_gated_core_output_plus_retrieved_summary():
    """h^{t+1} = Σ_b r_b m_b(before write) + (Σ_b r_b w_b)·u  (write, then read, expanded)."""
    model = build(tiny())
    randomise_routers(model)
    out = model(torch.randint(0, 97, (2, 8)), return_states=True)
    st = out.stages
    # rebuild the buffer step by step from the recorded routing
    e, p = st.embeddings, st.prelude
    buffer = torch.stack([e] + [torch.zeros_like(e)] * (model.scheme.slots - 1), -2)
    values = [p] + st.core_outputs
    for (w, r), value, h_next in zip(st.routing, values, st.states):
        gate = (r * w).sum(-1, keepdim=True)
        expected = torch.einsum("bts,btsd->btd", r, buffer) + gate * value
        torch.testing.assert_close(h_next, expected, rtol=0, atol=1e-5)
        buffer = buffer + w.unsqueeze(-1) * value.unsqueeze(-2)


def test_more_loops_than_trained_reuse_the_last_router_pair():
    model = build(tiny(spec="1+1R2+1"))
    randomise_routers(model)
    x = torch.randint(0, 97, (1, 6))
    out = model(x, loops=4, return_states=True)
    assert len(out.stages.states) == 5 and len(out.stages.routing) == 5
    last = model.scheme.routers[-1]
    for (w, _), h in zip(out.stages.routing[3:], out.stages.states[2:4]):
        torch.testing.assert_close(w, last(h)[0])
    fewer = model(x, loops=1, return_states=True)
    assert len(fewer.stages.states) == 2


def test_loops_override_needs_a_single_core():
    from meshlm.errors import ConfigError

    model = build(tiny(spec="1+1+1+1"))
    with pytest.raises(ConfigError, match="single-core spec"):
        model(torch.zeros(1, 3, dtype=torch.long), loops=3)


def test_buffer_view_equals_explicit_slot_arithmetic():
    """The coefficient form holds exactly the slots m_b of the paper after every write."""
    from meshlm.model.schemes import LoopContext

    model = build(tiny(spec="1+1R3+1"))
    randomise_routers(model)
    scheme, d, slots = model.scheme, model.config.d_model, model.scheme.slots
    e, p, *us = torch.randn(2 + 3, 2, 5, d).unbind(0)
    ctx = LoopContext(e=e)
    explicit = [e] + [torch.zeros_like(e)] * (slots - 1)
    h = scheme.begin(ctx, p)
    queries_values = [(p, p)]
    for t, u in enumerate(us):
        queries_values.append((h, u))
        h = scheme.update(t, h, u, ctx)
    for (_, value), (w, _) in zip(queries_values, ctx.routing):
        explicit = [m + w[..., b:b + 1] * value for b, m in enumerate(explicit)]
    torch.testing.assert_close(scheme.buffer(ctx), torch.stack(explicit, -2), rtol=0, atol=1e-5)
    r_last = ctx.routing[-1][1]
    torch.testing.assert_close(h, sum(r_last[..., b:b + 1] * m for b, m in enumerate(explicit)),
                               rtol=0, atol=1e-5)


# -- elastic depth: router pairs up to the cap, uniform-routing ablation ---------------------------
def test_router_pairs_follow_max_loops_and_fewer_loops_read_through_pair_k():
    model = build(tiny(spec="1+1R2+1", max_loops=6))
    # cap + 1 pairs; slots stay K + 3
    assert len(model.scheme.routers) == 7 and model.scheme.slots == 5
    randomise_routers(model)
    x = torch.randint(0, 97, (1, 6))
    for loops in (1, 3, 6, 9):
        out = model(x, loops=loops, return_states=True)
        assert len(out.stages.routing) == loops + 1
        for step, ((w, r), h) in enumerate(zip(out.stages.routing[1:], out.stages.states[:-1])):
            # step t uses pair t+1; beyond the cap the last
            pair = model.scheme.routers[min(step + 1, 6)]
            torch.testing.assert_close((w, r), pair(h))


def test_max_loops_at_k_is_todays_model_bit_for_bit():
    a, b = build(tiny(spec="1+1R2+1")), build(tiny(spec="1+1R2+1", max_loops=2))
    assert a.state_dict().keys() == b.state_dict().keys()
    x = torch.randint(0, 97, (2, 7))
    assert torch.equal(a(x).logits, b(x).logits)


def test_uniform_routing_has_no_router_parameters_and_routes_evenly():
    model = build(tiny(spec="1+1R2+1", scheme_options={"routing": "uniform"}, max_loops=4))
    assert sum(p.numel() for p in model.scheme.parameters()) == 0
    out = model(torch.randint(0, 97, (2, 5)), loops=4, return_states=True)
    for w, r in out.stages.routing:
        assert torch.equal(w, torch.full_like(w, 1 / model.scheme.slots)) and torch.equal(r, w)
    # uniform write and read: every slot gets v/B, so a read is (e + Σ written values) / B
    st = out.stages
    expected = (st.embeddings + st.prelude + sum(st.core_outputs)) / model.scheme.slots
    torch.testing.assert_close(st.states[-1], expected, rtol=1e-5, atol=1e-6)


def test_bad_routing_and_max_loops_are_one_line_errors():
    from meshlm.errors import ConfigError

    with pytest.raises(ConfigError, match="routing='frozen' must be one of: learned, uniform"):
        tiny(scheme_options={"routing": "frozen"})
    with pytest.raises(ConfigError, match="max_loops=1 must be an integer >= the spec's 2"):
        tiny(spec="1+1R2+1", max_loops=1)
    with pytest.raises(ConfigError, match="max_loops=4 needs a single-core spec"):
        tiny(spec="1+1+1+1", max_loops=4)
