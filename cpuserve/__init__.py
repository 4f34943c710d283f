"""cpuserve: fast quantized LLM inference on CPU-only machines."""

__version__ = "0.1.0"
