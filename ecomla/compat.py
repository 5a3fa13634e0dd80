"""The differences between transformers versions that ecomla's own models meet, in one place.

transformers 5.24 renamed the cache argument of `forward` and the cache field of the model outputs from
`past_key_values` to `cache` (the old argument name stays accepted, deprecated, until 5.40). ecomla's models
(`ecomla.decode.absorbed`, `ecomla.lrkv.modeling`) and the KV measurement (`ecomla.eval.kv`) speak whichever
name the installed version uses, through these helpers (`create_causal_mask` took the same rename).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable


def cache_field(output_class: type) -> str:
    """The name of the cache field of a transformers ModelOutput class in this version."""
    return "cache" if "cache" in {f.name for f in dataclasses.fields(output_class)} else "past_key_values"


def output_cache(out):
    """The cache a model output carries, under either field name (None when it carries none)."""
    return getattr(out, cache_field(type(out)), None)


def cache_argument(forward: Callable) -> str:
    """The name under which `forward` takes the cache in this version."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
