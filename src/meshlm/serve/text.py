"""Tokens to text for the server: incremental decoding with stop strings, and chat prompts.

`TextStream` turns a request's tokens into text deltas as they arrive. It holds back what could
still change: a trailing incomplete UTF-8 character (U+FFFD while its bytes are missing) and any
tail that is the start of a stop string, so no delta ever has to be taken back. When a stop string
appears, the text before it is the completion (OpenAI's rule: the stop string itself is not
returned) and the request can be stopped.

Chat prompts use the model folder's own chat template (chat_template.jinja or
tokenizer_config.json's `chat_template`, a Jinja template, rendered sandboxed as transformers does)
when it has one, else DEFAULT_CHAT_TEMPLATE:

    System: …            one line per message, the role capitalised
    User: …
    Assistant:           the prompt ends here; generation continues the assistant's turn

With the default template, generation also stops at "\\nUser:" (DEFAULT_CHAT_STOP), where a model
trained on plain text would start writing the user's next turn.
"""
from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshlm.errors import ConfigError

DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] "
                         "}}\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
DEFAULT_CHAT_STOP = ("\nUser:",)


class TextStream:
    """Text deltas of a growing token list, cut at the first stop string."""

    def __init__(self, decode, stop: list[str], eos_id: int | None = None):
        self.decode, self.stop, self.eos_id = decode, [s for s in stop if s], eos_id
        self.tokens: list[int] = []
        self.shown = ""  # text already returned
        self.stopped = False  # a stop string was found: nothing after it counts

    def add(self, tokens: list[int]) -> str:
        """The next delta after `tokens` (possibly empty)."""
        if self.stopped:
            return ""
        self.tokens.extend(t for t in tokens if t != self.eos_id)
        text = self.decode(self.tokens)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith("\ufffd"):  # the rest of a multi-byte character is still to come
            text = text[:-1]
        return self._emit(text[:len(text) - self._held(text)])

    def finish(self) -> str:
        """The rest of the text once generation ended (an incomplete character stays U+FFFD)."""
        if self.stopped:
            return ""
        text = self.decode(self.tokens)
        cut = self._first_stop(text)
        return self._emit(text if cut is None else text[:cut])

    @property
    def text(self) -> str:
        return self.shown

    def _emit(self, text: str) -> str:
        if not text.startswith(self.shown) or len(text) <= len(self.shown):
            return ""  # decoding changed earlier text (a merge across tokens): wait for more
        delta, self.shown = text[len(self.shown):], text
        return delta

    def _first_stop(self, text: str) -> int | None:
        """Index of the earliest stop string in the text not yet shown (searching from where one
        could start)."""
        start = max(0, len(self.shown) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)


def chat_template(own: str | None) -> tuple[str, bool]:
    """(template, whether it is the model's own): `own` (the opened folder's,
    meshlm.loading.ModelFolder.chat_template), else DEFAULT_CHAT_TEMPLATE."""
    return (own, True) if own is not None else (DEFAULT_CHAT_TEMPLATE, False)


def render_chat(template: str, messages: list[dict], **tokens: str) -> str:
    """The prompt text for `messages` ([{"role", "content"}]), rendered in a sandbox (templates
    cannot reach Python objects or files). ConfigError when the template fails (a role it refuses, a
    bad template)."""
    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                **tokens)
    except TemplateError as err:
        raise ConfigError(f"the chat template refused these messages: {err}") from err
