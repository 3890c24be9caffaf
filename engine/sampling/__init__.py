"""From logits to tokens, and the per-request rules around it.

``sampler`` (logits rules, penalties, temperature and the draw), ``logits_rules`` (logit_bias,
allowed tokens, bad words, grammars), ``stop_rules`` (when a sequence ends), ``beam_search``
(Hugging Face's beam scoring, behind one object the engine consults) and ``speculation`` with
``draft_model`` (drafts that one forward pass verifies).
"""
