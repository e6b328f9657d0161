"""attn-spec: property-based conformance checks and a teaching kit for transformer attention.

    >>> import attn_spec
    >>> report = attn_spec.check(my_attention)   # a function attention(Q, K, V, mask=None)
    >>> report.conforms
"""
from attn_spec import failures
from attn_spec.errors import Unsupported  # a target raises it to decline an input (light: no torch)
from attn_spec.version import __version__

__all__ = ["__version__", "check", "check_property", "reproduce", "Unsupported"]


def __getattr__(name):  # PEP 562: `import attn_spec` stays cheap (the pytest plugin imports it in every run)
    if name in ("check", "check_property", "reproduce"):
        from attn_spec import api
        return getattr(api, name)
    raise AttributeError(f"module 'attn_spec' has no attribute {name!r}")


def _word(because: failures.Because) -> str:  # the catalog names causes, the diagnosis words them (imported late)
    from attn_spec.diagnosis.causes import word

    return word(because)


failures.word_causes_with(_word)
