"""The OpenAI-compatible API over the async engine: `create_app` and its `ServerConfig`.

Kept as the import path serve.py and the tests use; the app itself is routes.py, and each
concept has its module: errors, auth, tokenizing, streaming, completions, chat, logprobs.
"""

from cpuserve.server.routes import create_app
from cpuserve.server.state import ServerConfig

__all__ = ["ServerConfig", "create_app"]
