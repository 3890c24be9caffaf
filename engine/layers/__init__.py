"""Building blocks that the model files in engine/models compose: norms, rotary embeddings,
MLPs, mixture-of-experts and the paged self-attention block."""
