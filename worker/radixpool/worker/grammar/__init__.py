"""Structured output: JSON schema, regex and EBNF constraints through xgrammar.

- `compiler.py`: the model's xgrammar tokenizer info (built once, on the compile thread), the
  compile thread and the compile cache keyed by (kind, source). A constrained request waits in
  `GrammarQueue` until its grammar is compiled; the engine keeps stepping the others meanwhile.
- `mask.py`: one step's token masks: every constrained row's bitmask filled on the host, moved to
  the device once, special tokens the grammar does not allow cleared, unpacked to a boolean mask
  in one tensor op; the sampler applies it to those rows only.
- `matcher.py`: a request's grammar state: accepts each sampled token and finds the text the
  grammar forces next; jump-forward "retokenize" re-tokenizes it together with the sampled token
  the way the tokenizer would split it and appends it, computed in one extend step.
- `draft.py`: jump-forward "exact": the forced text's tokens are a draft that the next step
  verifies in one extend, keeping only the tokens token-by-token decoding would have chosen.
xgrammar is imported only here, on first use: an engine that never sees a constraint never
loads it.
"""
