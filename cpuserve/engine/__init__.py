"""The serving engine: requests in, batched forward passes over a paged KV cache, tokens out."""
