"""Offline tools, above the model: `cpuserve quantize` (RTN, SmoothQuant + GPTQ calibration) and
GGUF conversion. Nothing here runs while serving, except converting the bundled GGUF once."""
