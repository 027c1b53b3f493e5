"""The GPU soak (bench/gpu_soak.py) on CPU for a few seconds, with its whole feature mix: it must
pass on a sound engine, and its checks must catch a broken grammar mask."""

from __future__ import annotations

import pytest

from bench import gpu_soak
from radixpool.worker.grammar.mask import GrammarMasks

SHORT_RUN = ["--seconds", "2", "--device", "cpu", "--max-len", "128", "--max-live", "12",
             "--check-every", "5", "--report-every", "600"]


def test_short_soak_with_every_feature_passes(capsys):
    assert gpu_soak.main(SHORT_RUN) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for feature in gpu_soak.FEATURES:
        assert f"\n{feature}: " in out, out
    assert "VIOLATION" not in out and "KV slots leaked 0" in out


def test_soak_fails_naming_the_feature_when_grammar_masks_let_eos_through(
        capsys, monkeypatch: pytest.MonkeyPatch):
    build = GrammarMasks.build

    def leaky(self, *args, **kwargs):   # EOS allowed everywhere: outputs end mid-grammar
        mask = build(self, *args, **kwargs)
        mask[..., 2] = True   # </s> in the tiny tokenizer
        return mask

    monkeypatch.setattr(GrammarMasks, "build", leaky)
    assert gpu_soak.main([*SHORT_RUN, "--features", "json,regex", "--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION json" in out or "VIOLATION regex" in out, out
