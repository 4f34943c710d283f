"""What `--kv-cache-dtype` may name and what the cache then stores (torch-free: serve checks its flags
before the thread plan, which must run before torch is imported)."""

from __future__ import annotations

from cpuserve.errors import ConfigError

# The int8 cache (engine/kv_int8.py). vLLM's fp8 spellings ask for an 8-bit cache, which is this one
# here (int8 rows with their own scales; these CPUs have no fp8 arithmetic); the log says so.
INT8_NAMES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# A 16-bit float cache under any compute dtype: a float32 engine (a CPU without native bf16 dot
# products) then reads half the bytes a decode step's attention reads; the kernels widen each row in
# registers and compute in fp32 whatever the cache holds.
FLOAT_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def kv_cache_storage(kv_cache_dtype: str) -> str | None:
    """What the cache holds: "int8", "bfloat16", "float16", or None for "auto" (the model's compute
    dtype, or the checkpoint's where --dtype auto computes it in float32: model/footprint.py
    auto_kv_storage); a name it does not know is a ConfigError (a cache dtype is never silently
    replaced)."""
    if kv_cache_dtype in INT8_NAMES:
        return "int8"
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype in FLOAT_NAMES:
        return FLOAT_NAMES[kv_cache_dtype]
    raise ConfigError(
        f"--kv-cache-dtype {kv_cache_dtype}: one of auto (the model's dtype), bfloat16, float16, int8 "
        f"(also spelled {', '.join(INT8_NAMES[1:])}: int8 rows with per-row scales)"
    )


def is_int8(kv_cache_dtype: str) -> bool:
    """True for the int8 cache; else False, or a ConfigError for a name it does not know."""
    return kv_cache_storage(kv_cache_dtype) == "int8"
