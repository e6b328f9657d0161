"""The default grading rubric (TOML), kept apart so that ``--print-rubric`` imports nothing heavy."""

DEFAULT_RUBRIC = """\
# attn-spec grading rubric. Print it with `attn-spec grade --print-rubric`, edit, pass with --rubric.
# Grading is derandomised: the profile and seed fix every input, so a submission always gets the
# same grade. Every key is optional (a missing key takes the value shown here).

# quick grades a correct submission in 1 to 3 s (a class of 30 in about 40 s on 2 cores, --jobs 2);
# default tries about 4x more and larger cases and takes about 8x longer; thorough, longer still.
profile = "quick"
seed = 20240917
dtypes = ["float64", "float32", "float16", "bfloat16"]
devices = ["cpu"]
# A folder submission is imported from the first of these files it has (or its only .py file).
entry = ["attention.py", "submission.py", "main.py", "__init__.py"]
# A failure that a root's mistake explains (the grader replays it and the mistake model reproduces
# its calls) is that root's symptom: it keeps its points, so one bug is charged once, at the weight of
# the most important property it breaks. true charges every failure.
charge_blocked = false

[limits]
import_seconds = 20          # to import a submission (--timeout overrides this and call_seconds)
call_seconds = 10            # for any one call into it
submission_seconds = 300     # wall clock for one whole submission; its CPU time is capped at the same
memory_mb = 1024             # address space on top of what Python and torch already map
output_kb = 64               # stdout + stderr kept per submission (the rest is counted and dropped)
file_mb = 16                 # largest file a submission may write
source_kb = 512              # largest source file accepted
folder_mb = 64               # largest submission, all its files together (links are copied as links)

[forbidden]
# Calls a submission may not make: a dotted name, or a module followed by .* for all of it.
calls = [
    "torch.nn.functional.scaled_dot_product_attention",
    "torch.nn.functional.multi_head_attention_forward",
    "torch.nn.MultiheadAttention",
    "attn_spec.reference.*",   # the answer it is judged by
    "attn_spec.checking.tolerance.*",   # the kit's naive attentions
]
penalty = 1.0                # fraction of the score removed when one is used: 1.0 = zero, 0.0 = report only

[function]                   # attention(Q, K, V, mask=None)
name = "attention"
# required: counts in max_score even when missing; when-defined: counts only when defined (so
# max_score then differs between students who define it and those who do not);
# bonus: its points add to the score, never to max_score (attempting it never lowers a grade).
policy = "required"
default_points = 1.0         # any property not listed below

[function.points]
rows-sum-to-one = 2
causal-mask = 2
permutation-equivariance = 1
scale-sqrt-dk = 2
cross-attention-shapes = 1
matches-reference = 2

# A named mistake costs the points of the most important property it breaks. To price one yourself
# (taken from its heaviest broken properties first, at most what they are worth), uncomment:
# [function.mistakes]
# softmax-over-queries = 4

[module]                     # class MultiHeadAttention(d_model, n_heads) in the seed's form
name = "MultiHeadAttention"
policy = "bonus"             # optional: graded when defined, its points on top of the function's
# A small bonus: 2.3 points in all on a CPU machine (about a tenth of the function's 21), so a
# perfect module never outweighs a bug in the function.
default_points = 0.1

[module.points]
head-concat-equivalence = 0.5
scale-sqrt-dk = 0.2
matches-reference = 0.3
"""
