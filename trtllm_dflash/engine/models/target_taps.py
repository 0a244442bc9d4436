"""Target model classes for ``trtllm-build --model_cls_file``: TensorRT-LLM 1.2.x's Llama / Qwen3 decoders plus one
extra engine output, ``contract.TAPS_OUTPUT``: the outputs of the decoder layers in ``target_layer_ids``
(HF ``hidden_states[i + 1]``), concatenated along the hidden dimension, [num_tokens, K·H] in the engine dtype.

Runs only inside NVIDIA's TensorRT-LLM container (``tensorrt_llm`` imported at module top). What it relies on, with
sources, is in ``tests/data/trtllm_1_2_1/model_api.json``:
- ``MODEL_MAP['LlamaForCausalLM'] = LLaMAForCausalLM``, ``MODEL_MAP['Qwen3ForCausalLM'] = QWenForCausalLM``;
- their ``transformer.layers`` is a ``DecoderLayerList`` that calls each layer as a ``Module`` (``__call__`` ->
  ``self.forward``), and a layer returns ``(hidden_states, presents)`` with ``use_cache``, hidden_states being the
  residual stream after the MLP (reduce_fusion, which changes that, is off: we never enable it);
- ``Module.__setattr__`` keeps a plain callable as an instance attribute, so wrapping a tap layer's ``forward`` on the
  instance records its output without renaming any parameter (weights still load by their checkpoint names);
- ``register_network_output`` only makes debug outputs; a real extra output is ``Tensor.mark_output(name, dtype)``.

The tap layers come from the sibling drafter checkpoint (``layout.tap_layer_ids``): ``trtllm-build`` gives a model class
only the directory it builds from, and the target's config.json is TensorRT-LLM's, untouched.
"""

from __future__ import annotations

from tensorrt_llm.functional import concat
from tensorrt_llm.models import LLaMAForCausalLM, QWenForCausalLM

from trtllm_dflash.engine import contract, layout


class _Taps:
    """Mixin: record the tap layers' outputs during ``forward`` and mark their concatenation as an engine output."""

    def _install_taps(self, layer_ids: tuple[int, ...]) -> None:
        num_layers = self.config.num_hidden_layers
        if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
            raise ValueError(f"dflash target_layer_ids {list(layer_ids)} must be in [0, {num_layers})")
        self._tap_ids = tuple(layer_ids)
        self._tap_values = {}
        layers = self.transformer.layers
        for i in self._tap_ids:
            layer = layers[i]
            layer.forward = self._recording(i, layer.forward)

    def _recording(self, i: int, forward):
        def forward_and_record(*args, **kwargs):
            out = forward(*args, **kwargs)
            self._tap_values[i] = out[0] if isinstance(out, tuple) else out  # [num_tokens, hidden]
            return out

        return forward_and_record

    def forward(self, *args, **kwargs):
        self._tap_values.clear()
        outputs = super().forward(*args, **kwargs)
        taps = concat([self._tap_values[i] for i in self._tap_ids], dim=-1)  # [num_tokens, K·H]
        taps.mark_output(contract.TAPS_OUTPUT, self.config.dtype)
        return outputs

    @classmethod
    def from_checkpoint(cls, ckpt_dir, rank=None, config=None, *, preprocess_weights_hook=None):
        model = super().from_checkpoint(ckpt_dir, rank=rank, config=config,
                                        preprocess_weights_hook=preprocess_weights_hook)
        ids = layout.tap_layer_ids(ckpt_dir)
        model.config.dflash_target_layer_ids = list(ids)  # lands in the engine's config.json (pretrained_config)
        model._install_taps(ids)
        return model


class DFlashLlamaWithTaps(_Taps, LLaMAForCausalLM):
    pass


class DFlashQwen3WithTaps(_Taps, QWenForCausalLM):
    pass


# The class names the build passes as --model_cls_name (contract.TARGET_CLASS); checked here so a rename fails loudly.
assert {c.__name__ for c in (DFlashLlamaWithTaps, DFlashQwen3WithTaps)} == set(contract.TARGET_CLASS.values())
