"""The serving kernels' properties (family ``serving``): a decode step against its KV cache (decode), its paged
cache (paged), chunked prefill (prefill), split-KV partial states (splits), merging two partial states (merge),
packed variable-length batches (varlen) and the LSE a kernel returns (lse)."""
