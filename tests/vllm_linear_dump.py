"""Run by the vLLM environment's python (tests/test_vllm_plugin.py): load a checkpoint in vLLM
(offline, in-process, eager) and, for every linear the cpuserve plugin took, run it on fixed
inputs; save inputs and outputs (safetensors) for the test to compare with cpuserve's own layers,
plus the kernel class vLLM chose for every linear.

usage: python vllm_linear_dump.py CHECKPOINT OUT.safetensors OUT.json [--dtype float32] [--no-tokenizer]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model lives in this process


def dump(model) -> dict:  # type: ignore[no-untyped-def]
    import torch

    tensors, kernels = {}, {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "kernel", None) if scheme is not None else None
        if kernel is not None:
            kernels[name] = type(kernel).__name__
        if getattr(module, "cpuserve_op", None) is None or method is None:
            continue  # not taken by the plugin
        g = torch.Generator().manual_seed(len(tensors))
        x = torch.randn(5, module.input_size_per_partition, generator=g) * 3
        x[:, 7] *= 40  # an outlier channel, as real activations have
        tensors[f"{name}.x"] = x
        for dtype in (torch.float32, torch.bfloat16):
            # as LinearBase.forward calls it: LinearMethod -> scheme -> kernel, with the layer's bias
            bias = None if getattr(module, "skip_bias_add", False) else getattr(module, "bias", None)
            y = method.apply(module, x.to(dtype), bias)
            tensors[f"{name}.y.{str(dtype).split('.')[-1]}"] = y.float().contiguous()
    return {"tensors": tensors, "kernels": kernels}


def main() -> int:
    from safetensors.torch import save_file
    from vllm import LLM

    ckpt, out_tensors, out_json = sys.argv[1:4]
    dtype = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "float32"
    llm = LLM(
        ckpt, enforce_eager=True, dtype=dtype, max_model_len=256, skip_tokenizer_init="--no-tokenizer" in sys.argv
    )
    [result] = llm.apply_model(dump)
    save_file(result["tensors"], out_tensors)
    with open(out_json, "w") as f:
        json.dump(result["kernels"], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
