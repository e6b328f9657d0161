"""The ``mask-mod`` and ``score-mod`` conventions: FlexAttention's mods, checked against a statement the user names.

    mask_mod(b, h, q_idx, kv_idx) -> bool          (True = query q_idx may attend key kv_idx)
    score_mod(score, b, h, q_idx, kv_idx) -> score

Both are evaluated as FlexAttention evaluates them: vmapped over every (b, h, q_idx, kv_idx) with 0-d integer
tensors (``create_mask``), so a mod that FlexAttention accepts is read exactly as it would be used.

Mask statements (``--expect-mask``; join several with ``+``, e.g. ``causal+document:0,0,1,1``):

- ``causal``: kv_idx <= q_idx;
- ``sliding-window:W``: q_idx - W < kv_idx <= q_idx (W keys, the query's own included: Hugging Face's and
  Mistral's convention);
- ``prefix-lm:P``: kv_idx < P or kv_idx <= q_idx (the first P keys are seen by every query);
- ``document:IDS``: ids[q_idx] == ids[kv_idx], with IDS the document id of each position (0,0,1,1,1).

Score statements (``--expect-score``): ``alibi`` (score + m_h (kv_idx - q_idx) with m_h = 2^(-8 (h+1) / H); H
read from head 0's slope, or given as ``alibi:H``), ``softcap:C`` (C tanh(score / C)), ``relative-bias``
(score + b_h(kv_idx - q_idx): a bias that depends only on the head and the distance).
"""
from __future__ import annotations

import math
import warnings

import torch

from attn_spec.failures import fail
from attn_spec.reference import visible
from attn_spec.errors import KitUsageError, Unsupported
from attn_spec.targets.base import Target, _call
from attn_spec.vocabulary import Traits

MASK_FORMS = "causal|sliding-window:W|prefix-lm:P|document:IDS"
SCORE_FORMS = "alibi|softcap:C|relative-bias"


def _int(text: str, what: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise KitUsageError(f"{what}: {text!r} is not an integer >= {low}")
    return value


class MaskStatement:
    """A parsed --expect-mask: parts (name, argument) that all must allow a pair."""

    def __init__(self, text: str):
        self.text, self.parts = text, []
        for part in text.split("+"):
            name, _, arg = part.strip().partition(":")
            where = f"--expect-mask {text}"
            if name == "causal" and not arg:
                self.parts.append(("causal", None))
            elif name in ("sliding-window", "prefix-lm") and arg:
                self.parts.append((name, _int(arg, where, 1 if name == "sliding-window" else 0)))
            elif name == "document" and arg:
                ids = [_int(x, where, 0) for x in arg.split(",")]
                self.parts.append(("document", torch.tensor(ids)))
            else:
                raise KitUsageError(f"{where}: unknown statement {part!r}; statements: {MASK_FORMS} (join with +)")
        lengths = {len(arg) for name, arg in self.parts if name == "document"}
        if len(lengths) > 1:
            raise KitUsageError(f"--expect-mask {text}: the documents have different lengths")
        self.length = lengths.pop() if lengths else None  # a document statement fixes the sequence length
        # keys a window or prefix spans: sizes beyond it are where its edges show
        self.reach = max([arg + 1 for name, arg in self.parts if name in ("sliding-window", "prefix-lm")], default=0)

    def dense(self, n_q, n_kv, replace=None) -> torch.Tensor:
        """Bool [Tq, Tk]; ``replace``: (index of a part, its stand-in [Tq, Tk]) for a near miss."""
        i, j = torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]  # [Tq, 1], [1, Tk]
        out = torch.ones(n_q, n_kv, dtype=torch.bool)
        for index, (name, arg) in enumerate(self.parts):
            if replace is not None and replace[0] == index:
                out = out & replace[1]
            else:
                out = out & _part(name, arg, i, j)
        return out


def _part(name, arg, i, j):
    if name in ("causal", "sliding-window"):  # the kit's rule, top-left: i - w < j <= i
        return visible(i[:, 0], j.shape[-1], window=arg if name == "sliding-window" else None)
    if name == "prefix-lm":
        return visible(i[:, 0], j.shape[-1]) | (j < arg)
    return arg[i] == arg[j]  # document


class ScoreStatement:
    """A parsed --expect-score."""

    def __init__(self, text: str):
        self.text = text
        name, _, arg = text.strip().partition(":")
        where = f"--expect-score {text}"
        if name == "alibi":
            self.name, self.arg = name, (_int(arg, where, 1) if arg else None)
        elif name == "softcap" and arg:
            try:
                self.name, self.arg = name, float(arg)
            except ValueError:
                raise KitUsageError(f"{where}: {arg!r} is not a number") from None
            if not self.arg > 0:
                raise KitUsageError(f"{where}: the cap must be positive")
        elif name == "relative-bias" and not arg:
            self.name, self.arg = name, None
        else:
            raise KitUsageError(f"{where}: unknown statement; statements: {SCORE_FORMS}")


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """m_h = 2^(-8 (h + 1) / H): ALiBi's geometric slopes (Press et al., 2022)."""
    return torch.exp2(-8.0 * (torch.arange(n_heads, dtype=torch.float64) + 1) / n_heads)  # [H]


class ModTarget(Target):
    """A mod is not an attention: no attend(), no probes of behaviours or capabilities, only its own properties."""

    is_attention = False

    def lacks_option(self, key):
        return f"a {self.convention} is not an attention"

    def _attend(self, q, k, v, mask, **options):
        raise Unsupported(f"a {self.convention} is not an attention: only its own properties apply", total=True)

    def _run(self, fn, call):
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

        self.calls += 1
        with warnings.catch_warnings(), TransformGetItemToIndex():
            warnings.simplefilter("ignore")
            return _call(fn, (), call, self.state)


class MaskModTarget(ModTarget):
    traits = Traits("mask-mod", "mask_mod(b, h, q_idx, kv_idx) -> bool, against --expect-mask STATEMENT",
                    kind="mod", trained=False, layout="indices", keywords=("expect_mask",), detect_rank=40)

    @staticmethod
    def detects(obj, names) -> bool:  # (b, h, q_idx, kv_idx)
        return len(names or ()) == 4 and {"q_idx", "kv_idx"} <= set(names)

    def __init__(self, obj, name, expect_mask=None, **kwargs):
        super().__init__(obj, name, **kwargs)
        self.statement = MaskStatement(expect_mask) if expect_mask else None

    def notes(self):
        return [f"statement: {self.statement.text}" if self.statement else
                f"statement: none named (--expect-mask {MASK_FORMS}); checking what every mask needs"]

    def options(self):
        return {"expect_mask": self.statement.text} if self.statement else {}

    def dense(self, B, H, n_q, n_kv) -> torch.Tensor:
        """The mask_mod over every (b, h, q_idx, kv_idx): bool [B, H, Tq, Tk]."""
        from torch.nn.attention.flex_attention import _vmap_for_bhqkv

        b, h, i, j = (torch.arange(n) for n in (B, H, n_q, n_kv))
        call = f"{self.name}(b, h, q_idx, kv_idx) over B={B}, H={H}, S_q={n_q}, S_kv={n_kv}"
        out = self._run(lambda: _vmap_for_bhqkv(self.obj, prefix=())(b, h, i, j), call)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool or tuple(out.shape) != (B, H, n_q, n_kv):
            fail(f"{out.dtype}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}", what="the mask_mod's result",
                 expected="a bool for each pair", call=call,
                 cause="a mask_mod returns a bool tensor: True where q_idx may attend kv_idx")
        return out

    def picture(self):
        n = (self.statement.length or min(32, max(8, self.statement.reach + 3))) if self.statement else 8
        return {"title": f"{self.name}(0, 0, q_idx, kv_idx), S_q = S_kv = {n}", "kind": "mask",
                "matrix": self.dense(1, 1, n, n)[0, 0].tolist()}


class ScoreModTarget(ModTarget):
    traits = Traits("score-mod", "score_mod(score, b, h, q_idx, kv_idx) -> score, against --expect-score STATEMENT",
                    kind="mod", trained=False, layout="indices", keywords=("expect_score",), detect_rank=41)

    @staticmethod
    def detects(obj, names) -> bool:  # (score, b, h, q_idx, kv_idx)
        return len(names or ()) == 5 and {"q_idx", "kv_idx"} <= set(names)

    def __init__(self, obj, name, expect_score=None, **kwargs):
        super().__init__(obj, name, **kwargs)
        self.statement = ScoreStatement(expect_score) if expect_score else None

    def notes(self):
        return [f"statement: {self.statement.text}" if self.statement else
                f"statement: none named (--expect-score {SCORE_FORMS})"]

    def options(self):
        return {"expect_score": self.statement.text} if self.statement else {}

    def scores(self, score) -> torch.Tensor:
        """score_mod(score[b, h, q, kv], b, h, q, kv) for every index of ``score`` [B, H, Tq, Tk]."""
        from torch.nn.attention.flex_attention import _vmap_for_bhqkv

        B, H, n_q, n_kv = score.shape
        b, h, i, j = (torch.arange(n) for n in (B, H, n_q, n_kv))
        call = f"{self.name}(score, b, h, q_idx, kv_idx) over B={B}, H={H}, S_q={n_q}, S_kv={n_kv}, {score.dtype}"
        out = self._run(lambda: _vmap_for_bhqkv(self.obj, prefix=(0,))(score, b, h, i, j), call)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(score.shape) or not out.is_floating_point():
            fail(f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}",
                 what="the score_mod's result", expected="a float score for each pair", call=call,
                 cause="a score_mod returns the modified score: a float tensor like the score it gets")
        return out

    def picture(self):
        """The bias added to a score of 0 at head 0, or, where there is none, what the mod makes of a row of scores."""
        heads = self.statement.arg if self.statement and self.statement.name == "alibi" and self.statement.arg else 1
        bias = self.scores(torch.zeros(1, heads, 8, 8, dtype=torch.float64))[0, 0]
        if bias.abs().max() > 0:
            return {"title": f"{self.name}(0, 0, 0, q_idx, kv_idx): the bias added to a score of 0, head 0",
                    "kind": "score", "matrix": bias.tolist()}
        scores = torch.tensor([[-100.0, -10.0, -1.0, 0.0, 1.0, 10.0, 100.0]], dtype=torch.float64)
        return {"title": f"{self.name}(score, 0, 0, 0, kv_idx) (row 2) for the scores of row 1", "kind": "score",
                "matrix": torch.cat([scores, self.scores(scores[None, None])[0, 0]]).tolist()}


def inferred_heads(slope0: float) -> int | None:
    """H such that head 0's ALiBi slope 2^(-8/H) is ``slope0``; None if there is none."""
    if not 0 < slope0 < 1:
        return None
    heads = -8.0 / math.log2(slope0)
    return round(heads) if abs(heads - round(heads)) < 1e-6 and round(heads) >= 1 else None
