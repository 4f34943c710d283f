"""What `--kv-cache-dtype` may name (torch-free: serve checks its flags before the thread plan, which
must run before torch is imported)."""

from __future__ import annotations

from cpuserve.errors import ConfigError

# The int8 cache (engine/kv_int8.py). vLLM's fp8 spellings ask for an 8-bit cache, which is this one
# here (int8 rows with their own scales; these CPUs have no fp8 arithmetic); the log says so.
INT8_NAMES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
BF16_NAMES = ("bfloat16", "bf16")


def is_int8(kv_cache_dtype: str) -> bool:
    """True for the int8 cache, False for "auto" (the model's dtype) or bfloat16; else a ConfigError
    (a cache dtype is never silently replaced)."""
    if kv_cache_dtype in INT8_NAMES:
        return True
    if kv_cache_dtype == "auto" or kv_cache_dtype in BF16_NAMES:
        return False
    raise ConfigError(
        f"--kv-cache-dtype {kv_cache_dtype}: one of auto (the model's dtype), bfloat16, int8 "
        f"(also spelled {', '.join(INT8_NAMES[1:])}: int8 rows with per-row scales)"
    )


def kv_cache_is_int8(kv_cache_dtype: str, model_dtype: str) -> bool:
    """is_int8, and bfloat16 honoured only when the model computes in bf16 (the float cache holds the
    model's dtype): model_dtype as torch prints it without "torch." ("float32", "bfloat16")."""
    if kv_cache_dtype in BF16_NAMES and model_dtype != "bfloat16":
        raise ConfigError(
            f"--kv-cache-dtype {kv_cache_dtype}: the KV cache holds the model's dtype, {model_dtype} here; "
            "use --kv-cache-dtype auto or int8, or --dtype bfloat16"
        )
    return is_int8(kv_cache_dtype)
