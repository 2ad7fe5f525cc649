"""The server's text layer: deltas never taken back, stop strings across tokens, chat templates."""
import json

import pytest

from meshlm.data.tokenizer import folder_chat_template
from meshlm.errors import ConfigError
from meshlm.serve.text import DEFAULT_CHAT_TEMPLATE, TextStream, chat_template, render_chat


def chars(ids):
    """A tokenizer whose token i is the character chr(i), and 0 is EOS."""
    return "".join(chr(i) for i in ids)


def feed(stream, text):
    return [stream.add([ord(c)]) for c in text]


def test_deltas_add_up_to_the_text_and_stop_strings_cut_across_tokens():
    s = TextStream(chars, ["END", "xyz"], eos_id=0)
    deltas = feed(s, "abcEN")
    # "E", "EN" could start "END": held back
    assert "".join(deltas) == "abc" and deltas[-2:] == ["", ""]
    assert s.add([ord("D")]) == "" and s.stopped and s.text == "abc"
    assert s.add([ord("q")]) == "" and s.finish() == ""


def test_a_held_back_tail_that_does_not_stop_is_released():
    s = TextStream(chars, ["END"], eos_id=0)
    assert "".join(feed(s, "aEN")) == "a"
    assert s.add([ord("o")]) == "ENo" and not s.stopped
    s.add([ord("E")])
    # generation ended: the held tail is the text's end
    assert s.finish() == "E" and s.text == "aENoE"


def test_eos_is_not_text_and_incomplete_characters_wait():
    s = TextStream(lambda ids: bytes(ids).decode("utf-8", "replace"), [], eos_id=0)
    snowman = "\u2603".encode()
    assert s.add([snowman[0]]) == "" and s.add([snowman[1]]) == ""
    assert s.add([snowman[2], 0]) == "\u2603" and s.text == "\u2603"


def test_chat_templates_default_and_folder(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    assert chat_template(folder_chat_template(tmp_path)) == (DEFAULT_CHAT_TEMPLATE, False)
    own = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor "
           "%}<|assistant|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": own}))
    template, is_own = chat_template(folder_chat_template(tmp_path))
    assert (is_own
            and render_chat(template, messages, eos_token="</s>") == "<|user|>hi</s><|assistant|>")
    refusing = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ConfigError, match="refused these messages: only user turns"):
        render_chat(refusing, messages)
    with pytest.raises(ConfigError, match="refused"):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", messages)  # sandboxed


def test_the_folder_template_is_read_as_finetune_reads_it(tmp_path):
    """One reader (meshlm.data.tokenizer.folder_chat_template) for serve and finetune:
    chat_template.jinja wins over tokenizer_config.json, and transformers' named list gives its
    "default" entry."""
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert chat_template(folder_chat_template(tmp_path)) == ("D", True)
    (tmp_path / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert chat_template(folder_chat_template(tmp_path)) == ("J", True)

