"""The words of the causes the catalog names: a property raises ``cause=because("key", **facts)``
(:class:`attn_spec.failures.Because`) and :func:`word` words it when the failure is raised.

Each entry of :data:`WORDS` is a sentence (``str.format`` with the facts, :data:`SENTENCES`) or a function of the
facts that returns one (a diagnosis that reads the measured tensors, or probes the target further:
:mod:`~attn_spec.diagnosis.causes_formula`, :mod:`~attn_spec.diagnosis.causes_code`). The property names the
behaviour it checks; how the likely bug is said lives here, beside the mistake catalog it quotes.
"""
from __future__ import annotations

from typing import Callable

from attn_spec.diagnosis import causes_code, causes_formula
from attn_spec.failures import Because

# The sentences: a cause with no numbers of its own (or only a few, formatted in), by the behaviour it names.
SENTENCES: dict[str, str] = {
    # the output against the reference, batches and positions
    "batch-mixed": "batch elements are mixed (a reshape or view that interleaves the batch with "
                   "the sequence dim, e.g. batch-first read as sequence-first?)",
    "broadcast-read-contiguous": "broadcast (stride-0) inputs are read as if contiguous",
    "depends-on-token-positions": "outputs depend on token positions (heads split without "
                                  "transpose?)",
    "depends-on-key-positions": "outputs depend on key positions (a built-in mask or positional "
                                "term?)",
    "depends-on-query-positions": "outputs depend on query positions ({where})",
    "device-differs": "the {device} code path computes a different function than the CPU one",
    "broadcast-rejected": "broadcast (stride-0) inputs are rejected: a .view() on an expanded tensor? (use "
                          ".reshape())",
    "not-convex": "the output is not a convex combination of the value rows (negative weights, or "
                  "weights that do not sum to 1?)",
    "weights-not-softmax": "weights are not a softmax (no exp?)",
    "alibi-not-in-scores": "the bias is right alone (q = 0) but not added to the scaled scores "
                           "before the softmax (scaled by 1/sqrt(d_k) with them, or added after "
                           "the softmax?)",
    # masks
    "output-reads-future": "the output reads the future even though the weights look causal",
    "causal-off-by-one": "the causal mask is off by one (triu with diagonal=0 masks the current "
                         "token?)",
    "masked-values-reach-output": "values at masked positions reach the output: their weight is "
                                  "not exactly 0",
    "finite-fill-above": "masked scores are replaced by a finite fill (masked_fill(~mask, -1e4) or -1e9) that lies "
                         "above the allowed scores, so the masked keys take the weight (fill with -inf or "
                         "finfo(dtype).min)",
    # gradients
    "backward-nan": "the backward produces NaN in {names}: it reads padding or out-of-range keys it does not mask "
                    "(0 * NaN), or divides by a zero sum",
    "backward-ignores-causal-mask": "the backward ignores the causal mask (weights recomputed "
                                    "without it?)",
    "backward-not-derivative": "the backward is not the derivative of the forward: finite "
                               "differences of the output disagree with the target's own "
                               "gradients (a custom autograd.Function whose backward does not "
                               "match its forward?)",
    # robustness
    "stale-cache": "returned the result of an earlier call for inputs at the same address: a "
                   "cache keyed by the inputs' data pointer or shape?",
    "nondeterministic": "the output changes from call to call: randomness at inference (dropout "
                        "left on: F.dropout defaults to training=True; added noise) or state kept "
                        "between calls (a KV cache left on, a reused buffer)",
    "tensor-without-device": "a tensor is created without device= (torch.zeros(shape) lands on "
                             "the CPU)",
    "reshaped-in-place": "{name} is transposed or reshaped in place (transpose_, t_, resize_?)",
    "gqa-contract-ignored": "the target ignores {contract}: K/V heads are not repeated to the query heads "
                            "(query head h reads KV head h // g)",
    "view-on-non-contiguous": "the code assumes contiguous inputs: .view() on a non-contiguous tensor (use "
                              ".reshape())?",
    "length-crash": "the target {crash}: a hard-coded size? (a deliberate limit is declared: raise "
                    "NotImplementedError past it, or a block_size of that size on the module)",
    # serving kernels
    "merge-empty-nan": "with both LSEs -inf, exp(s - max) is exp(-inf + inf) = NaN: guard the empty case",
    "decode-reads-outside-cache": "the kernel reads cache rows it must not attend: only "
                                  "[cache_leftpad, cache_seqlens + S_new) after the append",
    "decode-append-elsewhere": "the kernel writes the appended rows elsewhere than "
                               "[cache_seqlens, cache_seqlens + S_new), or writes other rows too",
    "paged-reads-outside": "the kernel reads pool slots it must not attend: only rows [0, "
                           "cache_seqlens + S_new) of each element, through its block table",
    "paged-append-elsewhere": "the kernel writes the appended rows elsewhere than their slots "
                              "through the block table, or writes other slots too",
    "paged-capacity-off-by-one": "the capacity check is off by one (>= where > is meant)",
    "paged-no-capacity-check": "the kernel does not check the length against its block table and "
                               "reads (or writes) past it silently (flash-attn #2709)",
    "prefill-depends-on-chunks": "the append depends on how the prompt was split into chunks",
    "merge-lse-max": "the merged LSE must be logaddexp(s_a, s_b): the max alone forgets the sum "
                     "of the rescaled weights",
    "lse-empty-row": "a row with no key has LSE -inf (the empty state of a merge); a kernel may "
                     "return another fixed value (flash-attn +inf, the CPU flash op 0), but the "
                     "same one for every empty row",
    "lse-layout": "the LSE is laid out [B, H, S_new] (one row per head), not as q's [B, S_new, H]",
    "varlen-empty-sequences": "the kernel cannot take sequences with no queries or no keys (or "
                              "max_seqlen = 1): guard the empty cases before the arithmetic",
    "varlen-mixes-sequences": "the kernel mixes sequences: a query reads keys or values outside "
                              "its own segment",
}


# Every cause the catalog names: the sentences, and the causes read from the facts (causes_formula, causes_code).
WORDS: dict[str, str | Callable[..., str]] = {**SENTENCES, **causes_formula.READ, **causes_code.READ}
if len(WORDS) != len(SENTENCES) + len(causes_formula.READ) + len(causes_code.READ):  # sanity check
    raise ValueError("a cause is worded twice")


def word(because: Because) -> str:
    """The sentence for ``because``: its entry (formatted with the facts, if any), or the entry called with them."""
    entry = WORDS[because.key]
    if callable(entry):
        return entry(**because.facts)
    return entry.format(**because.facts) if because.facts else entry
