"""Tokenizer, chat template and generation defaults of a model directory.

Uses the `tokenizers` library and a sandboxed Jinja environment directly rather than
transformers: the same results for these files at a fraction of the import time.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from cpuserve.errors import CheckpointError, CpuserveError


class ChatTemplateError(CpuserveError):
    """The chat template refused the messages or could not be rendered."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates are rendered as transformers
    # renders them, which writes plain JSON (and takes these options).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body, as is."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads this class attribute

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _joined(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    # newline-joined, as vLLM joins a message's text parts for a template that prints the content
    text = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return {**message, "content": text}


def _developer_as_system(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """OpenAI's `developer` role as `system` for a template that does not name it (as vLLM renders
    it), the system messages then merged into one first message ("\n\n" between them): templates
    that take a system prompt take it first, and some refuse one anywhere else."""
    if not any(m.get("role") == "developer" for m in messages) or "'developer'" in source or '"developer"' in source:
        return messages
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m.get("role") == "system"]
    if systems == [0]:
        return converted
    text = "\n\n".join(t for i in systems if (t := _joined(converted[i]).get("content")))
    return [{"role": "system", "content": text}, *(m for m in converted if m.get("role") != "system")]


def _continued(rendered: str, final: dict[str, Any]) -> str:
    """The rendered chat cut right after the final message's text (continue_final_message), so the
    model goes on writing that message instead of closing it: the text's last occurrence, trailing
    whitespace kept only where the template kept it."""
    text = final.get("content")
    if isinstance(text, list):  # parts: the last text part is what the model continues (transformers)
        text = next((p.get("text") for p in reversed(text) if isinstance(p, dict) and p.get("type") == "text"), None)
    if not isinstance(text, str) or not text.strip():
        raise ChatTemplateError("continue_final_message: the final message has no text to continue")
    at = rendered.rfind(text.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not print the final message's text")
    kept = text.lstrip()
    end = at + len(kept) if rendered.startswith(kept, at) else at + len(text.strip())
    return rendered[:end]


@functools.lru_cache(maxsize=64)
def _loops_over_content(source: str) -> bool:
    try:
        ast = _template_environment().parse(source)
    except TemplateError:
        return False  # rendering will say what is wrong
    return any(_is_content(loop.iter) for loop in ast.find_all(nodes.For))


def _is_content(node: Any) -> bool:
    """`x['content']` or `x.content` (possibly filtered): what a template iterates over to read parts."""
    while isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"


def _first_failing(render: Any, messages: list[dict[str, Any]]) -> int | None:
    """The index of the message a template fails on: the shortest failing prefix's last message
    (only run once rendering has failed; a template that needs the whole conversation may point
    earlier than the real culprit, so the message says which index it found, no more)."""
    for k in range(1, len(messages) + 1):
        try:
            render(messages[:k])
        except Exception:
            return k - 1
    return None


def _template_line(exc: BaseException) -> int | None:
    """The template line an error was raised at (jinja maps template frames to `<template>`)."""
    line = getattr(exc, "lineno", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _template_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox with what transformers' apply_chat_template offers templates: loop controls, the
    generation tag, plain-JSON tojson, raise_exception and strftime_now."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class GenerationDefaults:
    """`generation_config.json`: stop tokens and the sampling defaults a model ships with."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def load(cls, model_dir: Path) -> GenerationDefaults:
        cfg = _read_json(model_dir / "generation_config.json")
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            eos_token_ids=eos_ids,
            temperature=cfg.get("temperature") if cfg.get("do_sample", True) else 0.0,
            top_p=cfg.get("top_p"),
            top_k=cfg.get("top_k"),
            repetition_penalty=cfg.get("repetition_penalty"),
        )


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF = _byte_alphabet()


class Tokenizer:
    """Encode, decode and apply the chat template of one model."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (expected a fast-tokenizer tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path}: not a readable tokenizer ({exc})") from None
        config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled: dict[str, Any] = {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._special = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        # SentencePiece vocabularies (Gemma, Llama 2): `▁` for a space and `<0xNN>` byte pieces,
        # not GPT-2's byte alphabet.
        self._byte_fallback = bool(getattr(self._tok.model, "byte_fallback", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_off_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """What encode returns, computed with the GIL released: `tokenizers` lets go of the GIL in
        encode_batch but not in encode, so a server encoding on a worker thread this way does not
        stall its event loop or its engine thread for the length of a long prompt."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar engines build their token tries from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a piece of a UTF-8 character, possibly)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_fallback and piece not in self._special:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode()
        if piece in self._special or not all(c in _BYTE_OF for c in piece):
            return self.decode([token_id], skip_special_tokens=False).encode()
        return bytes(_BYTE_OF[c] for c in piece)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template: str | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render messages to the prompt text the model was trained on (or with `template`). Content
        given as a list of text parts reaches a template that loops over it as it is, and one that
        prints it joined into one string (see takes_content_parts). continue_final_message: the
        text ends where the final message's does (the model continues it)."""
        source = template or self.chat_template
        if source is None:
            raise ChatTemplateError("this model has no chat template; use a plain prompt or --chat-template")
        messages = _developer_as_system(messages, source)
        if continue_final_message:
            if not messages:
                raise ChatTemplateError("continue_final_message: there is no final message")
            rendered = self.apply_chat_template(messages, False, template, **extra)
            return _continued(rendered, messages[-1])
        if not _loops_over_content(source):
            messages = [_joined(m) for m in messages]
        compiled = self._compiled.get(source)
        if compiled is None:
            env = _template_environment()
            try:
                compiled = self._compiled[source] = env.from_string(source)
            except TemplateError as exc:
                raise ChatTemplateError(f"chat template does not compile: {exc}") from None

        def render(msgs: list[dict[str, Any]]) -> str:
            return compiled.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )

        try:
            return render(messages)
        except Exception as exc:
            # Messages go in as sent (a tool-call turn's content may be null), as transformers passes
            # them; a template that cannot take a null content (one that concatenates it) gets "",
            # as vLLM gives it, rather than failing the request.
            nulls = [m for m in messages if m.get("content", "") is None or "content" not in m]
            if nulls and not isinstance(exc, ChatTemplateError):
                try:
                    return render([m if m not in nulls else {**m, "content": ""} for m in messages])
                except Exception:
                    pass
            if isinstance(exc, ChatTemplateError):
                raise
            line = _template_line(exc)
            where = f" at template line {line}" if line else ""
            index = _first_failing(render, messages)
            which = f" on message {index}" if index is not None else ""
            raise ChatTemplateError(f"chat template failed{which}{where}: {type(exc).__name__}: {exc}") from None

    def takes_content_parts(self, template: str | None = None) -> bool:
        """Whether the template loops over a message's content (so it takes a list of content parts
        as sent, as transformers passes them) rather than printing it (then text parts are joined
        into one string first, as vLLM does for such templates)."""
        source = template or self.chat_template
        return bool(source) and _loops_over_content(source)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes the special tokens itself, so none are added on top.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
