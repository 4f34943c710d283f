"""Tokenization and chat templating off the event loop.

A 2,000-token prompt takes milliseconds to encode and a chat template as long to render; on the
event loop that time is a stall in every other client's stream. Here they run on a small thread
pool the server owns, and encoding goes through the tokenizer's GIL-releasing call, so the loop
(and the engine thread) keep running while a prompt is encoded. The engine only ever receives
token ids.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cpuserve.tokenizer import Tokenizer

T = TypeVar("T")

WORKERS = 2  # encodes run mostly without the GIL; two let a long prompt not queue a short one


class TokenizerPool:
    """The model's tokenizer, called from coroutines; each call runs on a worker thread."""

    def __init__(self, tokenizer: Tokenizer, workers: int = WORKERS) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cpuserve-tokenize")

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self.tokenizer.encode_off_gil, text, add_special_tokens)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template: str | None,
        template_kwargs: dict[str, Any],
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Render the chat template and encode the result, in one trip to a worker. The template
        writes the special tokens itself, so none are added on top unless asked (add_special_tokens,
        as vLLM takes it). ChatTemplateError passes through."""

        def render_and_encode() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                template=template,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
            return self.tokenizer.encode_off_gil(text, add_special_tokens=add_special_tokens)

        return await self._run(render_and_encode)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self.tokenizer.decode, ids, skip_special_tokens=skip_special_tokens)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
