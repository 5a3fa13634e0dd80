"""Fast decoding for converted (stock DeepSeek-V3) checkpoints: absorbed MLA over the latent cache."""

from ecomla.compat import output_cache
from ecomla.decode.absorbed import AbsorbedDeepseekV3ForCausalLM

__all__ = ["AbsorbedDeepseekV3ForCausalLM", "output_cache"]
