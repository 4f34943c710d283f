"""Engine limits used when no flag says otherwise (one place; imported by the CLI without torch)."""

MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
