"""Fine-tuning data: JSONL of {prompt, completion} or of chat {messages}, as example data
(meshlm.data.examples) whose loss mask covers the completion or the assistant turns only.

One JSON object per line (blank lines skipped), either form in one file:

    {"prompt": "Q: 2+2?\\nA:", "completion": " 4"}
        ids = prompt · completion · EOS; loss on completion and EOS
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
        rendered with a chat template through transformers' `apply_chat_template`; loss on every
        assistant turn as the template renders it (its end-of-turn text included) and on the EOS
        after a conversation that ends with one

The chat template, the first that applies: an explicit one (`meshlm finetune --chat-template FILE`),
the model folder's own (tokenizer_config.json "chat_template", as Hugging Face folders carry), else
DEFAULT_TEMPLATE:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n …

Assistant replies are found by rendering the conversation up to each assistant turn with the
generation prompt (the text before the reply) and up to the end of that turn: the reply is what the
second adds to the first. A template that does not render a conversation as an extension of its
prefixes is refused. The full text is tokenised once, and a token's loss counts when its first
character lies in a reply (token offsets), so the ids are exactly those of the rendered
conversation.

Each record goes to validation when a hash of its line falls in the validation share
(`val_fraction`, at least one record on each side). Every example is one window padded to the
longest (`block`); one longer than the model's context is an error naming its line.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from meshlm.data.cache_dir import cache_dir as resolve_cache
from meshlm.data.examples import Example, build_cached, write_split
from meshlm.data.prepare import ready_output_dir
from meshlm.data.shards import FORMAT, MANIFEST, read_manifest, token_dtype, write_manifest
from meshlm.data.tokenizer import TextTokenizer
from meshlm.errors import DataError

DEFAULT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ "
                    "message['content'] }}\n{% endfor %}{% if add_generation_prompt "
                    "%}<|assistant|>\n{% endif %}")
VERSION = 1  # bump when the rendering changes: cached fine-tuning data is keyed by it
DEFAULT_VAL_FRACTION = 0.05


class Renderer:
    """Turns one record into (ids, loss mask) with one tokenizer and chat template."""

    def __init__(self, tokenizer: TextTokenizer, template: str | None = None):
        # the chat-template engine (Jinja, sandboxed)
        from transformers import PreTrainedTokenizerFast

        self.tok, self.template = tokenizer, template or DEFAULT_TEMPLATE
        eos = tokenizer.hf.id_to_token(tokenizer.eos_id)
        self.fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf, eos_token=eos,
                                            bos_token=eos)

    def example(self, record: object, where: str) -> Example:
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            return self._chat(record["messages"], where)
        if isinstance(record, dict) and isinstance(record.get("prompt"), str) \
                and isinstance(record.get("completion"), str):
            prompt, completion = (self.tok.encode(record["prompt"]),
                                  self.tok.encode(record["completion"]))
            return (prompt + completion + [self.tok.eos_id],
                    [0] * len(prompt) + [1] * (len(completion) + 1))
        raise DataError(f"{where}: a record needs string fields \"prompt\" and \"completion\", or "
                        f"\"messages\" (a list of {{\"role\", \"content\"}}); got {_keys(record)}")

    def _chat(self, messages: list, where: str) -> Example:
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: every message needs string \"role\" and \"content\"; "
                                f"got {_keys(m)}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant turn, so nothing to "
                            "learn; add one")
        text, spans = self._render(messages, False, where), []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before, through = self._render(messages[:i], True,
                                               where), self._render(messages[:i + 1], False, where)
                if not (through.startswith(before) and text.startswith(through)):
                    raise DataError(f"{where}: the chat template does not render a conversation as "
                                    "an extension of its first turns, so the assistant turns "
                                    "cannot be located; use a template that only appends "
                                    "(--chat-template)")
                spans.append((len(before), len(through)))
        encoding = self.tok.hf.encode(text, add_special_tokens=False)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding.offsets]
        return encoding.ids + [self.tok.eos_id], mask + [int(messages[-1]["role"] == "assistant")]

    def _render(self, messages: list, generation_prompt: bool, where: str) -> str:
        if not messages:
            return ""
        try:
            return self.fast.apply_chat_template(messages, chat_template=self.template,
                                                 tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja2's TemplateError and what a template raises itself
            raise DataError(f"{where}: the chat template failed to render ({type(err).__name__}: "
                            f"{str(err).splitlines()[0][:120] if str(err) else 'no message'}); fix "
                            "the template or the record") from None


def _keys(value: object) -> str:
    return f"keys {sorted(value)}" if isinstance(value, dict) else type(value).__name__


def _prepared_kind(folder: Path) -> str:
    """What a prepared folder holds, from its manifest (an unreadable one: token shards)."""
    try:
        return "labelled task data" if "labels" in read_manifest(folder) else "token shards"
    except DataError:
        return "token shards"


def read_records(path: Path) -> list[tuple[str, object]]:
    """(where, record) per non-blank line: where = "file:line"."""
    if path.is_dir() and (path / MANIFEST).is_file():
        raise DataError(f"fine-tuning data {path} is a prepared folder ({_prepared_kind(path)}), "
                        "which fine-tuning cannot use; pass a JSONL file of prompt/completion or "
                        f"messages records, or train on the folder with `meshlm train "
                        f"train.data={path}`")
    if not path.is_file():
        raise DataError(f"fine-tuning data {path} "
                        f"{'is a folder' if path.is_dir() else 'does not exist'}; pass a JSONL "
                        "file of prompt/completion or messages records")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((f"{path}:{n}", json.loads(line)))
            except ValueError as err:
                raise DataError(f"{path}:{n}: "
                                f"not a JSON object ({err}); one record per line") from None
    if len(out) < 2:
        raise DataError(f"{path} holds {len(out)} record(s); fine-tuning needs at least 2 (one for "
                        "validation)")
    return out


def split_records(records: list, val_fraction: float) -> tuple[list, list]:
    """Validation: records whose line hashes into the first val_fraction (at least one, never
    all)."""
    def share(item) -> float:
        text = json.dumps(item[1], sort_keys=True).encode()
        return int(hashlib.sha256(text).hexdigest()[:8], 16) / 16 ** 8

    ranked = sorted(range(len(records)), key=lambda i: share(records[i]))
    n_val = min(len(records) - 1, max(1, sum(share(r) < val_fraction for r in records)))
    val = set(ranked[:n_val])
    return ([r for i, r in enumerate(records) if i not in val],
            [r for i, r in enumerate(records) if i in val])


def prepare_sft(data: str | os.PathLike, out: Path, tokenizer: TextTokenizer,
                template: str | None = None,
                context_length: int | None = None, val_fraction: float = DEFAULT_VAL_FRACTION,
                overwrite: bool = False) -> dict:
    """Render, tokenise and write `data` (JSONL) into `out` as example data; returns the
    manifest."""
    path, renderer = Path(data).expanduser(), Renderer(tokenizer, template)
    train, val = split_records(read_records(path), val_fraction)
    rendered = {split: [(where, renderer.example(r, where)) for where, r in records]
                for split, records in (("train", train), ("val", val))}
    where, (ids, _) = max((item for items in rendered.values() for item in items),
                          key=lambda item: len(item[1][0]))
    block = len(ids)
    if context_length is not None and block > context_length:
        raise DataError(f"{where}: the example is {block} tokens, longer than the model's context "
                        f"of {context_length}; shorten or drop it")
    examples = {split: [e for _, e in items] for split, items in rendered.items()}
    out = ready_output_dir(Path(out), overwrite)
    dtype = token_dtype(tokenizer.vocab_size)
    splits, masks = {}, {}
    for split, items in examples.items():
        splits[split], masks[split] = write_split(out, split, items, block, tokenizer.pad_id, dtype)
    manifest = {
        "format": FORMAT,
        "tokenizer": {"name": tokenizer.name, "hash": tokenizer.hash,
                      "vocab_size": tokenizer.vocab_size,
                      "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id},
        "dtype": dtype.name, "source": str(path), "val_fraction": val_fraction,
        "documents": len(train) + len(val), "replaced_bytes": 0, "splits": splits,
        "loss_mask": masks,
        "examples": {"block": block, "records": {"train": len(train), "val": len(val)},
                     "version": VERSION,
                     "template": "default" if template is None
                     else hashlib.sha256(template.encode()).hexdigest()[:16],
                     "loss_tokens": {s: int(sum(sum(m) for _, m in items))
                                     for s, items in examples.items()}},
    }
    write_manifest(out, manifest)
    return manifest


def cached_sft_data(data: str | os.PathLike, tokenizer: TextTokenizer, template: str | None = None,
                    context_length: int | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """`data` prepared once into the cache, keyed by its bytes, the tokenizer, the template and
    VERSION."""
    path = Path(data).expanduser()
    if not path.is_file():
        read_records(path)  # the one message for a missing file
    key = hashlib.sha256()
    for part in (path.read_bytes(), tokenizer.hash.encode(), (template or "").encode(),
                 str(VERSION).encode()):
        key.update(hashlib.sha256(part).digest())
    target = resolve_cache(cache_dir) / "prepared" / f"sft-{key.hexdigest()[:16]}"
    return build_cached(target, lambda folder: prepare_sft(path, folder, tokenizer, template,
                                                           context_length,
                                                           overwrite=True))
