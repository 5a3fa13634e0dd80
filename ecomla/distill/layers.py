"""Each layer's output of a causal LM during one forward, for intermediate-layer distillation (ILD).

A `LayerCatch` registers forward hooks on the decoder layers (or their attention modules) of a stock
transformers model for the length of a `with` block and keeps what they return: nothing in the model is
replaced or edited, and the hooks are gone when the block ends. With `feed`, each decoder layer reads the given
hidden states instead of its predecessor's output (teacher forcing: the source's inputs per layer).

    with LayerCatch(ILDTarget.BLOCK).on(model) as caught:
        model.get_decoder()(**inputs)
    caught.outputs   # L tensors (B, T, d), in layer order
    caught.rows(valid)   # the same at the positions of a (B, T) mask: L tensors (N, d)

`ILDTarget.ATTENTION_MAP` keeps each attention module's probabilities instead, (B, H, T, T), which only eager
attention returns (load the model with `attn_implementation="eager"`); their rows are (N, H, T).
"""

from __future__ import annotations

from torch import Tensor

from ecomla.distill.losses import ILDTarget


def decoder_layers(model) -> list:
    """The decoder layers of a causal LM (or of its decoder), in order."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return list(decoder.layers)


class LayerCatch:
    """Catches every layer's output (and, with `inputs`, its input) during the forward passes inside `on(model)`."""

    def __init__(self, target: ILDTarget, *, inputs: bool = False, feed: list[Tensor] | None = None):
        self.target = ILDTarget(target)
        self.keep_inputs = inputs
        self.feed = feed  # hidden states (B, T, d) each decoder layer reads instead of its predecessor's output
        self.outputs: list[Tensor | None] = []
        self.inputs: list[Tensor | None] = []
        self._handles: list = []
        self._model = None

    def on(self, model) -> LayerCatch:
        self._model = model
        return self

    @property
    def caught(self) -> bool:
        return bool(self.outputs) and all(o is not None for o in self.outputs)

    def __enter__(self) -> LayerCatch:
        layers = decoder_layers(self._model)
        if self.feed is not None and len(self.feed) != len(layers):
            raise ValueError(f"feed has {len(self.feed)} layer inputs for {len(layers)} layers")
        self.outputs = [None] * len(layers)
        self.inputs = [None] * len(layers)
        for i, layer in enumerate(layers):
            watched = layer if self.target is ILDTarget.BLOCK else layer.self_attn  # attention's output, or its map
            self._handles.append(watched.register_forward_hook(self._catch_output(i)))
            if self.keep_inputs or self.feed is not None:
                self._handles.append(layer.register_forward_pre_hook(self._on_input(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def rows(self, valid: Tensor) -> list[Tensor]:
        """Each layer's caught output at the positions where the (B, T) mask `valid` holds: (N, d) per layer, or
        (N, H, T) attention rows (one per query token) for ATTENTION_MAP."""
        if self.target is ILDTarget.ATTENTION_MAP:
            return [o.transpose(1, 2)[valid] for o in self.outputs]
        return [o[valid] for o in self.outputs]

    def _catch_output(self, i: int):
        def hook(module, args, out):
            if self.target is not ILDTarget.ATTENTION_MAP:
                self.outputs[i] = out[0] if isinstance(out, tuple) else out  # attention returns (output, weights)
                return
            weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if weights is None:
                raise RuntimeError(f"ild_target attention_map: layer {i}'s attention returned no probabilities; "
                                   "load the model with attn_implementation='eager' (sdpa and flash attention "
                                   "never form them)")
            self.outputs[i] = weights

        return hook

    def _on_input(self, i: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if self.keep_inputs:
                self.inputs[i] = hidden
            if self.feed is None:
                return None
            fed = self.feed[i].to(hidden.dtype)
            if args:
                return (fed, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": fed}

        return hook
