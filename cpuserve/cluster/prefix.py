"""Prompt prefixes as chained block hashes, and which replica last served each one.

The router cannot see a replica's prefix cache, and tokenizing in the ingress would cost what the
replica does again; so prefixes are compared as text. A request's prompt is flattened to one string
in the order the chat template renders it (tools, system, then each message's role and text); the
string is cut into blocks of BLOCK_CHARS and each block's hash covers everything before it (as the
engine's KV block hashes do), so two requests share the first k hashes exactly when their first
k blocks of text are equal. Only whole blocks count: a prompt shorter than one block has no prefix
worth routing for.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

BLOCK_CHARS = 256  # about 64 tokens: a few KV blocks, so one block of text is worth a replica's cache


def _text(value: Any) -> str:
    """The text of a message content, a content part list or a prompt, in order."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, dict):
        for key in ("text", "content", "input", "output", "function", "arguments"):
            if key in value:
                return _text(value[key])
        return json.dumps(value, sort_keys=True)
    return json.dumps(value)


def prompt_text(body: dict[str, Any]) -> str:
    """One string standing for the prompt of a completions, chat, responses, messages or embeddings body."""
    parts: list[str] = []
    if body.get("tools"):
        parts.append(json.dumps(body["tools"], sort_keys=True))
    for key in ("system", "instructions"):  # Anthropic's system, Responses' instructions
        if body.get(key):
            parts.append("\x00system\x00" + _text(body[key]))
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"\x00{m.get('role', '')}\x00{_text(m.get('content'))}{_text(m.get('tool_calls'))}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of prompts routes by its first
    if prompt is not None:
        parts.append(prompt if isinstance(prompt, str) else json.dumps(prompt))  # token ids as their numbers
    if body.get("input") is not None:  # Responses and embeddings
        parts.append(_text(body["input"]))
    return "".join(parts)


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[bytes]:
    """The chained hash of each whole block of `text`: hash k covers blocks 0..k."""
    hashes: list[bytes] = []
    previous = b""
    data = text.encode("utf-8", "surrogatepass")
    for start in range(0, len(data) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + data[start : start + block_chars], digest_size=16).digest()
        hashes.append(previous)
    return hashes


def request_prefix(body: bytes) -> list[bytes]:
    """The block hashes of a raw request body; none for a body that is not a JSON object."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []
    return block_hashes(prompt_text(parsed)) if isinstance(parsed, dict) else []


class PrefixTable:
    """Block hash -> the replica that last served a prompt with that prefix, least recently used out first."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, hashes: list[bytes], replicas: set[str]) -> tuple[str | None, int]:
        """The replica (among `replicas`) holding the longest prefix of `hashes`, and how many blocks."""
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner in replicas:
                return owner, depth
        return None, 0

    def record(self, hashes: list[bytes], replica: str) -> None:
        """`replica` now holds every block of this prompt (its prefix cache keeps what it computed)."""
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica that died or was removed holds nothing."""
        for h in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[h]
