"""The ``varlen`` convention: attention over a packed batch of sequences, flash-attn's signature detected as it is.

    out = flash_attn_varlen_func(q [T_q, H, D], k [T_k, H_kv, D], v [T_k, H_kv, D],
                                 cu_seqlens_q, cu_seqlens_k,  # int32 [B + 1]: sequence b is rows [cu[b], cu[b + 1])
                                 max_seqlen_q, max_seqlen_k,  # ints: the longest sequence of each
                                 dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, return_attn_probs=False, block_table=None)

PyTorch's ``varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
window_size=(-1, -1), ...)`` is the same call under other names (causal is ``window_size=(-1, 0)``; 2.9 had
``is_causal``); both are detected. The seven positional arguments are passed by position, the options by the
name the signature gives them, and only those it has.

Sequence b's queries attend its own keys only. Causal and the window are aligned bottom-right *per sequence*
(flash-attn's ``construct_local_mask``: query i of a sequence of n_q queries over n_k keys sits at key position
i + n_k - n_q), so a sequence with more queries than keys has rows that attend nothing: they give 0.

The header reports what the kernel does, probed on tiny inputs: the causal alignment and, where it returns an
LSE (flash-attn's ``return_attn_probs``, PyTorch's ``return_aux=AuxRequest(lse=True)``), its base, its layout
([H, T_q] in flash-attn 2.8, PyTorch's docstring says [T_q, H]) and the LSE of a row with no key. That last probe
runs in a forked child (attn_spec.targets.forked): the CPU flash op of torch 2.13 dies on zero keys.
"""
from __future__ import annotations

import math

import torch

from attn_spec.failures import fail
from attn_spec.errors import Unsupported
from attn_spec.targets.base import Target, _call, parameter_names
from attn_spec.targets.forked import call_in_child
from attn_spec.targets.serving_decode import _safely, natural_log, which_base
from attn_spec.vocabulary import Traits

F64 = torch.float64
POSITIONAL = {"flash": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
              "torch": ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")}
# option -> the parameter names that take it, in each dialect (the first one the signature has is used)
KEYWORDS = {"flash": {"scale": ("softmax_scale",), "causal": ("causal",), "window": ("window_size",),
                      "softcap": ("softcap",), "lse": ("return_attn_probs", "return_softmax_lse")},
            "torch": {"scale": ("scale",), "causal": ("is_causal", "window_size"), "window": ("window_size",),
                      "lse": ("return_aux",)}}


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 [B + 1]: 0, then the running sums of ``lengths``."""
    return torch.tensor([0, *torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32, device=device)


class VarlenTarget(Target):
    """``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, return_attn_probs=False)`` (or varlen_attn's names): the options it
    does not declare are never passed."""

    traits = Traits("varlen", "flash_attn_varlen_func(q [T_q, H, D], k, v [T_k, H_kv, D], cu_seqlens_q, "
                    "cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False, window_size=(-1, -1), "
                    "softcap=0.0, return_attn_probs=False, ...), or varlen_attn(query, key, value, cu_seq_q, cu_seq_k, "
                    "max_q, max_k, *, scale=None, window_size=(-1, -1), return_aux=None)", kind="serving",
                    trained=False, masks=(), layout="packed: q [T_q, H, D], k, v [T_k, H_kv, D]", detect_rank=34)

    @staticmethod
    def detects(obj, names) -> bool:  # a KV-cache kernel with cu_seqlens_q (FA3's) is a decode kernel
        return bool(names) and "k_cache" not in names and any(set(p[3:5]) <= set(names) for p in POSITIONAL.values())

    def __init__(self, obj, name, masks=None, **kwargs):
        super().__init__(obj, name, masks, **kwargs)
        names = parameter_names(obj) or ()
        self.dialect = "torch" if set(POSITIONAL["torch"][3:5]) <= set(names) else "flash"
        anything = "kwargs" in names and self.dialect == "flash"  # **kwargs: flash-attn's names are taken
        self.keywords = {option: next((n for n in candidates if anything or n in names), None)
                         for option, candidates in KEYWORDS[self.dialect].items()}
        self.keywords = {option: n for option, n in self.keywords.items() if n is not None}
        self.log = None  # a list while a failure is replayed (attn_spec.diagnosis.serving): every call kept
        self.probed = None

    @property
    def accepts(self) -> set:
        return set(self.keywords.values())

    def takes(self, option: str) -> bool:
        """Whether the signature has the option: scale, causal, window, softcap, lse."""
        return option in self.keywords

    def _attend(self, q, k, v, mask, **options):
        raise Unsupported("a varlen kernel is checked by the varlen properties (attn-spec list)", total=True)

    def lacks_option(self, key):
        return "a varlen kernel is checked by the varlen properties"

    def _keywords(self, causal, window, scale, softcap, lse) -> dict:
        wanted = {"causal": causal or None, "window": window, "scale": scale, "softcap": softcap, "lse": lse or None}
        missing = [option for option, value in wanted.items() if value is not None and option not in self.keywords]
        if missing:
            raise Unsupported(f"{self.name} takes no {', '.join(missing)} argument", total=True)
        given = {}
        if window is not None or (causal and self.keywords["causal"] == "window_size"):
            left, right = window if window is not None else (-1, -1)
            given["window_size"] = (left, 0 if causal else right)
        if causal and self.keywords["causal"] != "window_size":
            given[self.keywords["causal"]] = True
        if scale is not None:
            given[self.keywords["scale"]] = scale
        if softcap is not None:
            given[self.keywords["softcap"]] = softcap
        if lse:
            if self.keywords["lse"] == "return_aux":
                from torch.nn.attention.varlen import AuxRequest

                given["return_aux"] = AuxRequest(lse=True)
            else:
                given[self.keywords["lse"]] = True
        return given

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, window=None, scale=None, softcap=None,
               lse=False):
        """One call of the kernel: ``out`` [T_q, H, Dv], or ``(out, lse [H, T_q])`` with ``lse`` (transposed from
        [T_q, H] where that is the kernel's layout)."""
        given = self._keywords(causal, window, scale, softcap, lse)
        call = f"{self.name}(q, k, v, cu_seqlens_q, cu_seqlens_k, {max_q}, {max_k}" \
               f"{''.join(f', {key}={value!r}' for key, value in given.items() if key != 'return_aux')}" \
               f"{', return_aux=AuxRequest(lse=True)' if 'return_aux' in given else ''})"
        self.calls += 1
        with torch.no_grad():
            result = _call(lambda: self.obj(q, k, v, cu_q, cu_k, max_q, max_k, **given), (), call, self.state)
        out, found = (result[0], result[1]) if lse and isinstance(result, (tuple, list)) else (result, None)
        expected = (q.shape[0], q.shape[1], v.shape[-1])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
            fail(f"{list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}", what="the output",
                 expected=f"a tensor of shape {list(expected)}: [T_q, H, Dv]", call=call,
                 cause="a varlen kernel returns out [T_q, H, Dv] (and the LSE when asked for it)")
        found = self._lse_h_t(found, q.shape[1], q.shape[0], call) if lse else None  # [H, T_q]
        if self.log is not None:
            self.log.append({"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone(),
                             "cu_q": cu_q.tolist(), "cu_k": cu_k.tolist(), "causal": causal, "window": window,
                             "scale": scale, "softcap": softcap, "out": out.detach().clone(),
                             "lse": natural_log(found, self.probed)})
        return (out, found) if lse else out

    def _lse_h_t(self, found, H, T, call):
        """The returned LSE as [H, T_q]: flash-attn's layout, or [T_q, H] transposed (the probed layout decides
        where H = T_q)."""
        if not isinstance(found, torch.Tensor) or tuple(found.shape) not in ((H, T), (T, H)):
            fail(f"{list(found.shape) if isinstance(found, torch.Tensor) else type(found).__name__}",
                 what="the returned LSE", expected=f"[H, T_q] = {[H, T]} (or [T_q, H])", call=call,
                 cause="the LSE of a packed batch has one value per query row and head")
        transposed = (tuple(found.shape) == (T, H) and H != T) or (
            H == T and (self.probed or {}).get("lse-layout") == "[T_q, H]")
        return found.t() if transposed else found

    def forked(self, *args, **options):
        """``varlen(*args, **options)`` in a forked child (a kernel may die on zero keys): ("value", result), or
        what call_in_child says went wrong; the call is counted and kept (``log``) here, as in the parent."""
        def call():
            result = self.varlen(*args, **options)
            return result, (self.log[-1] if self.log else None)

        kind, value = call_in_child(call)
        self.calls += 1
        if kind == "value":
            result, record = value
            if self.log is not None and record is not None:
                self.log.append(record)
            return kind, result
        if kind == "raises" and value[2]:
            raise Unsupported(value[1], total=True)
        return kind, value

    def behaviour(self) -> dict:
        """Probed once on tiny float64 inputs: causal alignment, and the LSE's base, layout and empty-row value."""
        if self.probed is None:
            self.probed = {}
            for key, probe in PROBES.items():
                self.probed[key] = _safely(probe, self)
        return self.probed

    def notes(self):
        found = self.behaviour()
        return [f"varlen: causal alignment {found['causal-alignment']}, LSE: {found['lse-base']}, layout "
                f"{found['lse-layout']}, LSE of an empty row: {found['lse-empty-row']}",
                "calls: q [T_q, H, D], k, v [T_k, H_kv, D], cu_seqlens int32 [B + 1]; arguments it takes: "
                f"{', '.join(sorted(self.accepts)) or 'none'}; grouped heads (H_kv < H): {found['grouped-heads']}"]

    def draws(self) -> dict:
        """What its cases draw (attn_spec.targets.capabilities.Supports): grouped K/V heads where it takes them."""
        return {"gqa": self.behaviour()["grouped-heads"] == "yes"}


def _packed(segments, values=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0), heads=1):
    """q = k = 0 (every weighting uniform, readable from the output) over ``segments`` [(n_q, n_k), ...]; value
    row t of the packed keys is values[t]: (q, k, v, cu_q, cu_k, max_q, max_k)."""
    n_q, n_k = (sum(s[i] for s in segments) for i in (0, 1))
    q, k = torch.zeros(n_q, heads, 1, dtype=F64), torch.zeros(n_k, heads, 1, dtype=F64)  # [T, H, 1]
    v = torch.tensor(values[:n_k], dtype=F64).reshape(n_k, 1, 1).expand(n_k, heads, 1).contiguous()
    return (q, k, v, cu_seqlens(s[0] for s in segments), cu_seqlens(s[1] for s in segments),
            max(s[0] for s in segments), max(s[1] for s in segments))


def causal_alignment(target) -> str:
    """Two sequences of one query over 3 keys (values 1, 2, 3 and 4, 5, 6), causal: bottom-right per sequence,
    each query sees its sequence's three keys (means 2 and 5); top-left only the first (1 and 4)."""
    out = target.varlen(*_packed([(1, 3), (1, 3)]), causal=True).to(F64).flatten()
    found = tuple(round(x, 6) for x in out.tolist())
    names = {(2.0, 5.0): "bottom-right per sequence", (1.0, 4.0): "top-left per sequence"}
    return names.get(found, f"other (out {', '.join(f'{x:.4g}' for x in found)})")


def lse_base(target) -> str:
    """q = 0 over 3 keys: the LSE is ln 3 in base e, log2 3 in base 2."""
    if not target.takes("lse"):
        return "not returned"
    _, lse = target.varlen(*_packed([(1, 3)]), lse=True)
    return which_base(lse.to(F64).flatten()[0].item())


def lse_layout(target) -> str:
    """Two heads, one sequence of 3 queries: the raw LSE is [2, 3] ([H, T_q]) or [3, 2] ([T_q, H])."""
    if not target.takes("lse"):
        return "not returned"
    q, k, v, *rest = _packed([(3, 2)], heads=2)
    given = target._keywords(False, None, None, None, True)
    target.calls += 1
    with torch.no_grad():
        result = _call(lambda: target.obj(q, k, v, *rest, **given), (), f"{target.name}(..., lse)", target.state)
    shape = tuple(result[1].shape) if isinstance(result, (tuple, list)) and len(result) > 1 else None
    return {(2, 3): "[H, T_q]", (3, 2): "[T_q, H]"}.get(shape, f"other ({list(shape) if shape else 'none'})")


def lse_empty_row(target) -> str:
    """A sequence of one query and no key, next to one of (1, 1): its LSE is -inf (the empty state of a merge), or a
    value that is not neutral when merged (+inf, 0). Run in a forked child: a kernel may die on zero keys."""
    if not target.takes("lse"):
        return "not returned"
    kind, value = target.forked(*_packed([(1, 0), (1, 1)]), lse=True)
    if kind != "value":
        return {"crashes": f"crashes ({value})", "raises": f"raises ({value[0] if value else '?'})"}.get(kind, kind)
    found = value[1].to(F64)[0, 0].item()
    return "-inf" if found == -math.inf else f"{found:g} (not neutral in a merge: the empty state's LSE is -inf)"


def grouped_heads(target) -> str:
    """One sequence of 4 query heads over 2 key/value heads (flash-attn's k [T_k, H_kv, D]): "yes" where the kernel
    takes it (the properties then draw grouped heads; whether it groups them right is theirs to check), "no" where it
    raises (they draw none)."""
    q, k, v, *rest = _packed([(1, 3)], heads=4)
    try:
        target.varlen(q, k[:, :2], v[:, :2], *rest)
    except Exception as exc:  # noqa: BLE001 - the kernel declining grouped heads
        return f"no ({type(getattr(exc, 'exc', exc)).__name__})"
    return "yes"


PROBES = {"causal-alignment": causal_alignment, "lse-layout": lse_layout, "lse-base": lse_base,
          "lse-empty-row": lse_empty_row, "grouped-heads": grouped_heads}
