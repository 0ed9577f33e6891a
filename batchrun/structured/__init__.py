"""Structured outputs: JSON schema, regex, choice and EBNF grammars through xgrammar.

`compiler.StructuredOutputs` compiles a request's StructuredOutputsParams once per model (the tokenizer is
enough) and hands out one grammar matcher per sequence. Where the state lives and why:

- the matcher belongs to its Sequence, in the engine: its state is a function of the sequence's output
  tokens, and the engine already owns every event that touches them (the draw it appends, the fork of an
  n > 1 request, preemption, which never changes the tokens, so swap and recompute keep the matcher as it
  is, and the finish or abort that drops it). The engine holds it as an opaque `contract.GrammarState`:
  it calls `accept_token`, `is_terminated`, `is_completed` and `fork` and never imports torch or xgrammar.
- the runner reads the matchers of the step's constrained rows (SamplingRequest.grammar) to fill and apply
  the token bitmask, a tensor, in one vectorized call (model/sampling/grammar_mask.py).
So there is no second copy of per-sequence state to keep in step with the engine's.
"""
