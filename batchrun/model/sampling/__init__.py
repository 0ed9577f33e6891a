"""From a step's logits to its tokens: the sampling batch, the sampler, grammar masks."""
