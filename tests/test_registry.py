"""The convention registry (attn_spec.vocabulary, attn_spec.targets.base): every list of conventions derives
from the Target classes, and a new class is a new convention with no other edit."""
import pytest
import torch

from attn_spec import settings, vocabulary
from attn_spec.cli import main
from attn_spec.errors import KitUsageError
from attn_spec.targets import base
from attn_spec.targets.conventions import conventions, make_target


def test_the_lists_derive_from_the_traits():
    from attn_spec.targets import conventions as module

    assert module.CONVENTIONS == vocabulary.BUILTIN
    assert module.ATTENTION_CONVENTIONS == ("function", "sdpa", "module", "torch-mha", "adapter", "hf", "flex")
    assert module.MOD_CONVENTIONS == ("mask-mod", "score-mod")
    assert module.FUNCTION_CONVENTIONS == ("function", "sdpa", "hf", "flex")
    assert module.MULTIHEAD_CONVENTIONS == ("module", "torch-mha", "adapter")
    untrained = conventions(trained=False, kind="attention")
    assert untrained == ("sdpa", "torch-mha", "flex")  # a missing autograd is a skip for them


@pytest.fixture
def echo_convention():
    """A convention class defined here, as a user's or a new module's would be; unregistered afterwards."""
    class EchoTarget(base.Target):
        traits = vocabulary.Traits("echo-test", "echo(q, k, v): attention with a different name", detect_rank=5)

        @staticmethod
        def detects(obj, names) -> bool:
            return getattr(obj, "__name__", "") == "echo"

        def _attend(self, q, k, v, mask, *, scale=None, is_causal=False):
            self._no_extra_arguments(scale, is_causal)
            self.calls += 1
            return base._call(self.obj, (q, k, v), "echo(q, k, v)", self.state)

    yield EchoTarget
    del base.CLASSES["echo-test"], vocabulary.REGISTRY["echo-test"]


def echo(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


def test_a_new_convention_is_listed_and_accepted(echo_convention, capsys, tmp_path):
    assert "echo-test" in conventions(kind="attention") and "echo-test" in vocabulary.names()
    assert main(["list", "--conventions"]) == 0
    assert "echo-test" in capsys.readouterr().out
    assert settings._parse(settings.SETTINGS["convention"], "echo-test") == "echo-test"
    (tmp_path / "mine.py").write_text("import torch\n\ndef echo(q, k, v):\n"
                                      "    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) @ v\n")
    code = main(["check", f"{tmp_path / 'mine.py'}:echo", "--convention", "echo-test", "--profile", "quick",
                 "--only", "rows-sum-to-one", "--seed", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "echo-test convention" in out, out
    target = make_target(echo)  # detected by its own detects()
    assert type(target) is echo_convention and target.convention == "echo-test"


def test_an_unknown_convention_names_the_registered_ones():
    with pytest.raises(KitUsageError, match="function, sdpa"):
        make_target(echo, convention="nope")
    with pytest.raises(KitUsageError, match="must be one of"):
        settings._parse(settings.SETTINGS["convention"], "nope")
