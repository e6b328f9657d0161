"""Every distinct ``eager_attention_forward`` of the installed transformers, checked as Hugging Face calls it.

Found by import: each ``transformers.models.<model>.modeling_*`` module that defines its own (a modeling module
that fails to import, for a missing optional dependency, is skipped and counted), deduplicated by source
(comments and formatting aside: models copy the function with ``# Copied from`` lines). Each is checked with
``--convention hf --profile quick`` and must conform, or fail with the one root listed in KNOWN, with the reason.

By default one function per kind is checked (REPRESENTATIVE: this file takes about 35 s of CPU, a third of it
importing the modeling modules); ``ATTN_SPEC_HF_SWEEP=all`` checks all of them (28 functions for 356 models with
transformers 5.24: about 3 min of CPU).
"""
import re
import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
import textwrap
import warnings
from functools import lru_cache

import pytest

import attn_spec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers (the test extra) is not installed")

# The functions that do not conform, by a model that uses each: (the one root's mistake, why that is right).
KNOWN = {
    "vjepa2": ("mask-ignored", "V-JEPA 2's eager attention (adapted from ViT's) never reads attention_mask: its layers "
                               "pass None, so its own models are unaffected, but given a mask (as the same call to "
                               "sdpa_attention_forward honours) every query attends every key"),
}
# One function per kind, by a model that uses it: Llama's (GQA through repeat_kv), BERT's (MHA only: lacks gqa),
# Gemma 2's (softcap), ModernBERT-decoder's (adds attention_mask unconditionally: lacks unmasked), GPT-OSS's and
# Granite-SWA's (attention sinks, as an extra logit and as an LSE scaling), and the known failure.
REPRESENTATIVE = ("llama", "bert", "gemma2", "modernbert_decoder", "gpt_oss", "granite_swa", "vjepa2")


@lru_cache(maxsize=1)
def eager_functions():
    """({normalised source: (function, [model, ...])}, modeling modules that failed to import)."""
    import transformers.models

    found, failed = {}, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for package in pkgutil.iter_modules(transformers.models.__path__):
            try:
                models = importlib.import_module(f"transformers.models.{package.name}")
            except Exception:  # noqa: BLE001 - an optional dependency missing: counted
                failed += 1
                continue
            for module in pkgutil.iter_modules(getattr(models, "__path__", [])):
                if not module.name.startswith("modeling_") or module.name.startswith(("modeling_tf", "modeling_flax")):
                    continue
                name = f"{models.__name__}.{module.name}"
                try:
                    fn = getattr(importlib.import_module(name), "eager_attention_forward", None)
                except Exception:  # noqa: BLE001 - as above
                    failed += 1
                    continue
                if fn is not None and fn.__module__ == name:  # its own, not one imported from another model
                    key = ast.dump(ast.parse(textwrap.dedent(inspect.getsource(fn))))  # comments aside
                    found.setdefault(key, (fn, []))[1].append(package.name)
    return found, failed


def _selected():
    found, _ = eager_functions()
    groups = sorted(found.values(), key=lambda group: -len(group[1]))
    if os.environ.get("ATTN_SPEC_HF_SWEEP") == "all":
        return groups
    return [group for group in groups if set(group[1]) & set(REPRESENTATIVE)]


@pytest.mark.slow
def test_the_sweep_finds_the_functions():
    found, failed = eager_functions()
    models = sum(len(group[1]) for group in found.values())
    assert len(found) >= 10 and models >= len(found), (len(found), models, failed)
    named = {model for _, group in found.values() for model in group}
    assert set(REPRESENTATIVE) <= named and set(KNOWN) <= named  # the representatives still exist


@pytest.mark.slow
def test_every_distinct_eager_function_conforms_or_fails_for_its_known_reason():
    wrong = []
    for fn, models in _selected():
        report = attn_spec.check(fn, name=f"{models[0]} eager_attention_forward", convention="hf", profile="quick",
                                 seed=0)
        target = report.targets[0]
        known = [KNOWN[m] for m in models if m in KNOWN]
        roots = [d.mistake for d in target.diagnoses]
        if known and (report.conforms or roots != [known[0][0]]):
            wrong.append(f"{models[0]} ({len(models)} models): expected the one root {known[0][0]}, got {roots}")
        elif not known and not report.conforms:
            wrong.append(f"{models[0]} ({len(models)} models): {target.verdict}, roots {roots}\n{report}")
    assert not wrong, "\n".join(wrong)


def test_mha_only_functions_lack_gqa_and_sinks_have_no_effect():
    """BERT's raises on H_kv != H: lacks gqa, gqa-equivalence not checked; GPT-OSS's reads module.sinks (the
    stand-in's -inf sinks change nothing); ModernBERT-decoder's adds the mask unconditionally: lacks unmasked."""
    from transformers.models.bert.modeling_bert import eager_attention_forward as bert
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss
    from transformers.models.modernbert_decoder.modeling_modernbert_decoder import eager_attention_forward as decoder

    report = attn_spec.check(bert, convention="hf", profile="quick", seed=0, only=["gqa-equivalence", "matches-reference"])
    target = report.targets[0]
    assert report.conforms and target.capabilities["gqa"] == "no"
    assert re.search(r"lacks .*\bgqa \(", str(report)) and "skipped gqa-equivalence: not checked" in str(report)
    required = attn_spec.check(bert, convention="hf", profile="quick", seed=0, only=["gqa-equivalence"], require=["gqa"])
    results = {p.id: p.status for p in required.targets[0].properties}
    assert results == {"gqa-equivalence": "fail", "capability:gqa": "fail"}
    assert [d.mistake for d in required.targets[0].diagnoses] == ["gqa-kv-not-repeated"]
    snippet = required.targets[0].properties[0].counterexample["reproduce"]
    assert "--require gqa" in snippet and "require=['gqa']" in snippet
    with pytest.raises(attn_spec.errors.Failure):  # the reproduction requires GQA too
        exec(snippet, {})
    sinks = attn_spec.check(gpt_oss, convention="hf", profile="quick", seed=0, only=["matches-reference", "gqa-equivalence"])
    assert sinks.conforms and sinks.targets[0].capabilities["gqa"] == "yes", str(sinks)
    unmasked = attn_spec.check(decoder, convention="hf", profile="quick", seed=0, only=["matches-reference"])
    assert unmasked.conforms and unmasked.targets[0].capabilities["unmasked"] == "no", str(unmasked)
    assert "lacks unmasked" in str(unmasked)
