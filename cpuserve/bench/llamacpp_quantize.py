"""A GGUF re-quantized by llama.cpp itself (llama-cpp-python's llama_model_quantize, what
llama-quantize runs), so each type's file is what a user would download. Runs in the peer's Python
and imports nothing from cpuserve:

    python llamacpp_quantize.py SOURCE.gguf OUT.gguf FTYPE THREADS

FTYPE: llama.cpp's file type number (LLAMA_FTYPE_MOSTLY_*: 2 Q4_0, 3 Q4_1, 7 Q8_0, 15 Q4_K_M,
17 Q5_K_M, 18 Q6_K). Exits non-zero when llama.cpp reports a failure.
"""

import sys

import llama_cpp


def main() -> None:
    source, out, ftype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(source.encode(), out.encode(), params)
    if status != 0:
        sys.exit(f"llama_model_quantize {source} -> {out} (ftype {ftype}) failed: {status}")


if __name__ == "__main__":
    main()
