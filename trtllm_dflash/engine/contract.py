"""The I/O contract between our TensorRT-LLM engines (``trtllm_dflash.engine``) and the Triton models that run them
(``trtllm_dflash.serve`` with ``--backend trtllm-engine``). One place, imported by both sides and by the tests.

Three engines are built from one ``convert`` output (``DIR/target`` and ``DIR/drafter``):

``target``     the target LLM, built by ``trtllm-build`` with a model class of ours that subclasses TRT-LLM's Llama /
               Qwen3 decoder and additionally marks the concatenated tap hidden states (output of decoder layer i for
               each i in ``target_layer_ids``, i.e. HF ``hidden_states[i + 1]``) as the engine output ``TAPS_OUTPUT``.
               Runs under TRT-LLM's C++ executor (in-flight batching, paged KV cache with block reuse); drafts are
               verified as external draft tokens (``--speculative_decoding_mode draft_tokens_external``) and the taps
               come back through ``OutputConfig.additional_model_outputs`` (gather_context=True, so the prompt's
               rows are returned too).
``kv_inject``  the drafter's context projection (fc -> hidden_norm -> per layer k_proj/v_proj -> k_norm -> RoPE), built
               from ``DIR/drafter`` with our model class ``KV_INJECT_CLASS``; the ``dflash::kv_rope`` plugin does
               the norm + RoPE. Stateless; run with TRT-LLM's plain ``Session``.
``drafter``    one non-causal block forward over the sequence's context K/V plus the block's own K/V
               (``dflash::block_attention``), final norm, the target's LM head, argmax. Built from ``DIR/drafter``
               with ``DRAFTER_CLASS``. The context cache lives in the Triton model (device memory), not in TensorRT.

Shapes use: T new tokens (ragged over sequences), n sequences, B block size, L drafter layers, S context capacity,
K·H = len(target_layer_ids) × target hidden size, n_kv / hd the drafter's KV heads / head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("target", "kv_inject", "drafter")

TAPS_OUTPUT = "dflash_taps"  # target engine extra output: [num_tokens, K·H], the engine's dtype

TARGET_CLASS = {"LlamaForCausalLM": "DFlashLlamaWithTaps", "Qwen3ForCausalLM": "DFlashQwen3WithTaps"}
KV_INJECT_CLASS = "DFlashKVInjectForTRTLLM"
DRAFTER_CLASS = "DFlashDrafterForTRTLLM"


@dataclass(frozen=True, slots=True)
class TensorIO:
    name: str
    dtype: str  # "int32", or "model" for the engine's activation dtype
    shape: tuple[str, ...]  # symbolic; "-1"-free so tests can compare exactly


KV_INJECT_INPUTS = (
    TensorIO("taps", "model", ("T", "K*H")),
    TensorIO("position_ids", "int32", ("T",)),
)
KV_INJECT_OUTPUTS = (
    TensorIO("ctx_k", "model", ("L", "T", "n_kv", "hd")),
    TensorIO("ctx_v", "model", ("L", "T", "n_kv", "hd")),
)
DRAFTER_INPUTS = (
    TensorIO("block_ids", "int32", ("n", "B")),  # [bonus, MASK × (B−1)] per sequence
    TensorIO("position_ids", "int32", ("n", "B")),  # absolute positions of the block
    TensorIO("ctx_k", "model", ("L", "n", "S", "n_kv", "hd")),  # each sequence's injected context, padded to S
    TensorIO("ctx_v", "model", ("L", "n", "S", "n_kv", "hd")),
    TensorIO("ctx_lens", "int32", ("n",)),  # valid context rows per sequence
)
DRAFTER_OUTPUTS = (TensorIO("draft_ids", "int32", ("n", "B-1")),)
