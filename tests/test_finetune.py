"""Fine-tuning: responses-only loss (against a hand-masked cross-entropy), one example per window
(as if alone), PEFT LoRA (zero at init, merged = unmerged, r·(in + out) per target, optimizer state
only for what trains), bit-exact resume, per-loop LoRA on a retrofit, the merged export loading in a
clean process, and bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import build, tiny
from trainkit import ROOT, tiny_train, train_losses

from meshlm.adapters import LoraSpec, apply_lora, merge_lora, target_names
from meshlm.data.prepare import PreparedData
from meshlm.data.sft import DEFAULT_TEMPLATE, Renderer, prepare_sft
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.loading import open_model
from meshlm.serve.text import chat_template as serve_template
from meshlm.train.trainer import train

CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "2 plus 3?"},
                     {"role": "assistant", "content": "5."},
                     {"role": "user", "content": "and 4 plus 4?"},
                     {"role": "assistant", "content": "8, as 4 + 4 = 8."}]}


def records(n=40, seed=0):
    """Alternating prompt/completion and two-turn chat records about sums of digits."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a, b = (int(v) for v in torch.randint(0, 10, (2,), generator=g))
        if i % 2:
            out.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                     {"role": "assistant",
                                      "content": f"{a} plus {b} is {a + b}."}]})
        else:
            out.append({"prompt": f"Q: {a} plus {b}?\nA:", "completion": f" {a + b}"})
    return out


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    prepare_sft(write_jsonl(root / "sums.jsonl", records()), root / "prepared",
                load_tokenizer("default"))
    return root / "prepared"


def test_the_mask_covers_completions_and_assistant_turns_only():
    tok = load_tokenizer("default")
    renderer = Renderer(tok)
    ids, mask = renderer.example({"prompt": "Q: 1 plus 1?\nA:", "completion": " 2"}, "x")
    assert tok.decode(i for i, m in zip(ids, mask) if m) == " 2<|endoftext|>"
    ids, mask = renderer.example(CHAT, "x")
    assert tok.decode(ids).startswith("<|system|>\nBe brief.\n<|user|>\n2 plus "
                                      "3?\n<|assistant|>\n5.\n")
    assert tok.decode(i for i, m in zip(ids, mask) if m) == "5.\n8, as 4 + 4 = 8.\n<|endoftext|>"


def test_masked_loss_equals_hand_masked_cross_entropy(sft_data):
    data = PreparedData(sft_data, "train")
    block = data.manifest["examples"]["block"]
    x, y = (torch.from_numpy(a) for a in data.inputs_targets([0, 1, 2, 3], block))
    model = build(tiny(vocab_size=8192, context_length=128))
    renderer = Renderer(load_tokenizer("default"))
    with torch.no_grad():
        logits = model(x).logits
        loss = model(x, targets=y).loss
    terms = []
    for row, record in enumerate(_train_records(sft_data)[:4]):
        ids, mask = renderer.example(record, "x")
        for t in range(len(ids) - 1):
            if mask[t + 1]:  # the loss of predicting token t + 1 from position t
                terms.append(-F.log_softmax(logits[row, t], -1)[ids[t + 1]])
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=1e-6, atol=1e-6)


def _train_records(folder):
    """The training split's records in their order (the split keeps file order)."""
    from meshlm.data.sft import read_records, split_records

    source = PreparedData(folder, "train").manifest["source"]
    return [r for _, r in split_records(read_records(Path(source)), 0.05)[0]]


def test_each_window_is_its_example_alone(sft_data):
    data = PreparedData(sft_data, "train")
    block = data.manifest["examples"]["block"]
    renderer = Renderer(load_tokenizer("default"))
    x, _ = (torch.from_numpy(a) for a in data.inputs_targets([0, 1, 2, 3, 4, 5], block))
    model = build(tiny(vocab_size=8192, context_length=128, spec="1+2R2+1"))
    with torch.no_grad():
        batched = model(x).logits
        for row, record in enumerate(_train_records(sft_data)[:6]):
            ids, _ = renderer.example(record, "x")
            alone = model(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(batched[row, :len(ids)], alone, rtol=1e-5, atol=1e-5)


def lora_spec(**overrides):
    return LoraSpec(**{"rank": 4, "alpha": 8.0, "targets": "attention,mlp", **overrides})


@pytest.mark.parametrize("backbone", ["neox", "llama", "olmoe"])
def test_lora_at_initialisation_is_the_base_model_exactly(backbone):
    extra = {"n_kv_heads": 2} if backbone == "llama" else {}
    base = build(tiny(backbone=backbone, **extra))
    lora = apply_lora(build(tiny(backbone=backbone, **extra)), lora_spec())
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(lora(x).logits, base(x).logits)


def randomise_lora(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def test_merged_equals_unmerged():
    model = randomise_lora(apply_lora(build(tiny()), lora_spec(targets="core,attention,mlp")))
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        unmerged = model(x).logits
        merged = merge_lora(model)
        assert set(merged.state_dict()) == set(build(tiny()).state_dict())  # the plain model again
        torch.testing.assert_close(merged(x).logits, unmerged, rtol=1e-5, atol=1e-5)


def test_targets_by_role_and_name_and_their_size():
    model = build(tiny(spec="1+2R2+1"))
    assert target_names(model, "core,attention") == [f"cores.0.{j}.attention.{n}" for j in (0, 1)
                                                      for n in ("query_key_value", "dense")]
    assert target_names(model, "prelude,coda,mlp.down_proj") == []  # neox names it dense_4h_to_h
    assert target_names(model, "coda,dense_4h_to_h") == ["coda.0.mlp.dense_4h_to_h"]
    apply_lora(model, lora_spec(targets="attention"))
    lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert lora == 4 * 4 * ((32 + 96) + (32 + 32))  # 4 layers x r·(in + out) for qkv and dense


def test_optimizer_holds_only_the_trainable_parameters(sft_data, tmp_path):
    cfg = tiny_train(sft_data, tmp_path, lora_rank=4, seq_len=0, steps=2, save_every=0,
                     lora_targets="core")
    result = train(cfg)
    from meshlm.train import parallel
    from meshlm.train.plan import resolve
    from meshlm.train.trainer import Trainer

    plan = resolve(cfg.__class__.from_dict({**cfg.to_dict(), "name": "again"}))
    t = Trainer(plan, parallel.setup(plan))
    in_optimizer = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in t.model.parameters() if p.requires_grad}
    names = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert (in_optimizer == trainable and names
            and all(".lora_" in n and n.startswith("cores.") for n in names))
    t.train_step(0)
    assert {id(p) for p in t.optimizer.state} == trainable
    saved = torch.load(result.checkpoint / "state.pt", weights_only=True)["optimizer"]["state"]
    assert sorted(saved) == sorted(names)


def test_resume_of_a_lora_finetune_is_bit_identical(sft_data, tmp_path):
    """A run cut back to its step-4 checkpoint (as a crash after it leaves it) and resumed replays
    steps 5 … 8."""
    import shutil

    cfg = tiny_train(sft_data, tmp_path / "a", lora_rank=4, seq_len=0, steps=8, save_every=4,
                     keep_last=4)
    ref = train(cfg)
    cut = tmp_path / "b" / "run"
    shutil.copytree(ref.run_dir, cut)
    shutil.rmtree(cut / "step-000008")
    (cut / "latest").write_text("step-000004")
    resumed = train(tiny_train(sft_data, tmp_path / "b", lora_rank=4, seq_len=0, steps=8,
                               save_every=4,
                               keep_last=4), resume=True)
    assert resumed.start_step == 4 and sorted(resumed.losses) == [5, 6, 7, 8]
    assert train_losses(resumed.run_dir) == train_losses(ref.run_dir)
    a, b = (torch.load(r.checkpoint / "state.pt", weights_only=True)["optimizer"]["state"]
            for r in (ref, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)
    a, b = (open_model(r.run_dir).model.state_dict() for r in (ref, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_per_loop_lora_finetune_of_a_retrofit_trains_only_the_deltas(sft_data, tmp_path,
                                                                     llama_folder):
    from meshlm.cli import main

    retro = tmp_path / "retro"
    assert (main(["retrofit", str(llama_folder[0]), str(retro), "--spec", "1+1R2+1", "--core-init",
                  "block"]) == 0)
    cfg = tiny_train(sft_data, tmp_path, init_from=str(retro), model={"loop_lora_rank": 2},
                     trainable="loop_lora",
                     seq_len=0, steps=6, save_every=0, lr=1e-2)
    result = train(cfg)
    before, after = (open_model(retro).model.state_dict(),
                     open_model(result.run_dir).model.state_dict())
    changed = sorted(k for k in after if k not in before or not torch.equal(before[k], after[k]))
    assert changed and all(".loop_lora." in k for k in changed)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_finetune_then_export_loads_in_a_clean_process(tmp_path):
    """meshlm finetune (LoRA) -> <run>/merged -> convert --to hf -> transformers in a fresh
    interpreter, with the merged model's logits."""
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "MESHLM_CACHE": str(tmp_path / "cache")}

    def meshlm(*args):
        done = subprocess.run([sys.executable, "-m", "meshlm.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done

    meshlm("train", "model.preset=tiny", "model.vocab_size=8192", "train.steps=4",
           "train.seq_len=32",
           "train.name=base", "train.progress=false", "train.tensorboard=false", "train.dtype=fp32")
    data = write_jsonl(tmp_path / "sums.jsonl", records())
    meshlm("finetune", "runs/base", str(data), "train.steps=6", "train.eval_every=0",
           "train.progress=false",
           "train.tensorboard=false", "train.dtype=fp32", "train.lr=1e-2")
    meshlm("convert", "runs/base-ft/merged", "hf", "--to", "hf")
    # the template its data were rendered in travels with the run, the merged model and the export
    for folder in ("runs/base-ft", "runs/base-ft/merged", "hf"):
        assert (tmp_path / folder / "chat_template.jinja").read_text() == DEFAULT_TEMPLATE, folder
    opened = open_model(tmp_path / "runs" / "base-ft")
    assert serve_template(opened.folder.chat_template) == (DEFAULT_TEMPLATE, True)
    x = torch.randint(0, 8192, (2, 12))
    with torch.no_grad():
        expected = open_model(tmp_path / "runs" / "base-ft").model(x).logits
        base = open_model(tmp_path / "runs" / "base").model(x).logits
    assert not torch.allclose(expected, base)  # the adapters changed the model
    torch.save({"x": x, "logits": expected}, tmp_path / "expected.pt")
    check = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
             "m = AutoModelForCausalLM.from_pretrained('hf', trust_remote_code=True).eval()\n"
             "e = torch.load('expected.pt', weights_only=True)\n"
             "torch.testing.assert_close(m(e['x']).logits, e['logits'], rtol=1e-4, atol=1e-4)\n"
             "from transformers import AutoTokenizer\n"
             "chat = [{'role': 'user', 'content': '2+2'}]\n"
             "text = AutoTokenizer.from_pretrained('hf').apply_chat_template(\n"
             "    chat, tokenize=False, add_generation_prompt=True)\n"
             "assert text == '<|user|>\\n2+2\\n<|assistant|>\\n', repr(text)\n"
             "assert 'meshlm' not in sys.modules, 'the remote code imported meshlm'\nprint('ok')\n")
    clean = {**env, "PYTHONPATH": "", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=clean,
                          capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


@pytest.mark.parametrize("record, needle", [
    ({"text": "hello"}, "needs string fields \"prompt\" and \"completion\", or \"messages\""),
    ({"messages": [{"role": "user"}]}, "string \"role\" and \"content\""),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
])
def test_bad_records_are_one_line_errors(record, needle):
    with pytest.raises(DataError, match=needle) as err:
        Renderer(load_tokenizer("default")).example(record, "f.jsonl:3")
    assert str(err.value).startswith("f.jsonl:3: ") and "\n" not in str(err.value)


def test_a_template_that_fails_to_render_is_one_line():
    broken = DEFAULT_TEMPLATE.replace("{% endfor %}",
                                      "{{ raise_exception('no system turns') }}{% endfor %}")
    with pytest.raises(DataError, match="chat template failed to render.*no system turns") as err:
        Renderer(load_tokenizer("default"), broken).example(CHAT, "f.jsonl:1")
    assert "\n" not in str(err.value)


def test_bad_lora_settings_are_one_line_errors(sft_data, tmp_path):
    with pytest.raises(ConfigError, match="matches no Linear"):
        apply_lora(build(tiny()), lora_spec(targets="nothing_like_this"))
    with pytest.raises(ConfigError, match="lora_rank=-1"):
        tiny_train(sft_data, tmp_path, lora_rank=-1)
    with pytest.raises(ConfigError, match="trainable=.*unknown"):
        tiny_train(sft_data, tmp_path, trainable="everything")


def test_peft_with_gradient_checkpointing_on_the_hugging_face_export(tmp_path):
    """PEFT's get_peft_model on the exported model; gradient_checkpointing_enable() gives the same
    gradients."""
    from peft import LoraConfig, get_peft_model

    from meshlm.hf import from_meshlm

    def grads(checkpointed):
        hf = from_meshlm(build(tiny(spec="1+2R2+1", loop_lora_rank=2))).train()
        if checkpointed:
            getattr(hf, "activation_checkpointing_enable", hf.gradient_checkpointing_enable)()
            # really checkpointed
            assert all("forward" in layer.__dict__ for layer in hf.model.cores[0])
        peft_model = get_peft_model(hf, LoraConfig(r=4, target_modules=["query_key_value",
                                                                        "dense_4h_to_h"]))
        randomise_lora(peft_model)
        x = torch.randint(0, 97, (2, 9))
        peft_model(input_ids=x, labels=x).loss.backward()
        return {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}

    plain, recomputed = grads(False), grads(True)
    assert plain and plain.keys() == recomputed.keys()
    for name, g in plain.items():
        torch.testing.assert_close(recomputed[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_finetune_a_hugging_face_folder_and_its_merged_checkpoint(tmp_path, llama_folder,
                                                                  monkeypatch):
    """The CLI on a transformers Llama folder (its tokenizer, its architecture); <run>/merged is the
    merged model."""
    from meshlm.cli import main

    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    data = write_jsonl(tmp_path / "sums.jsonl", records(24))
    assert (main(["finetune", str(llama_folder[0]), str(data), f"train.out_dir={tmp_path}",
                  "train.name=ft",
                  "train.steps=3", "train.eval_every=0", "train.save_every=0",
                  "train.eval_windows=4",
                  "train.progress=false", "train.tensorboard=false", "train.lr=1e-2"]) == 0)
    run, merged = open_model(tmp_path / "ft"), open_model(tmp_path / "ft" / "merged")
    assert (run.merged and run.model.config == merged.model.config
            and run.model.config.backbone == "llama")
    x = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        assert torch.equal(run.model(x).logits, merged.model(x).logits)
        assert not torch.equal(run.model(x).logits, open_model(llama_folder[0]).model(x).logits)


def test_activation_checkpointing_with_lora_changes_nothing_but_memory(sft_data, tmp_path):
    common = dict(lora_rank=4, seq_len=0, steps=3, save_every=0, dtype="fp32")
    plain = train(tiny_train(sft_data, tmp_path / "plain", **common))
    checkpointed = train(tiny_train(sft_data, tmp_path / "ckpt", activation_checkpointing=True,
                                    **common))
    assert checkpointed.losses == plain.losses
