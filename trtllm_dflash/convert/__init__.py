"""Stage 1 of the pipeline: Hugging Face target + z-lab DFlash drafter -> TensorRT-LLM-format checkpoints
(``OUT/target``, ``OUT/drafter``, ``OUT/manifest.json``), optional FP8 / NVFP4 quantization of the target, the loaders
back, and ``inspect``.

Modules: ``weight_map`` (name maps as data, sharding), ``configs`` (config.json of both checkpoints, weight plans),
``checkpoint`` (``convert``), ``quant`` (FP8 / NVFP4 numerics), ``quantize`` (the quantize stage, drafter included
on request), ``loader`` (round trip), ``emulate`` (activation / KV-cache quantization emulated in the loaded models),
``agreement`` (greedy token agreement with the unquantized target), ``hf_export`` (modelopt unified HF checkpoint),
``summary`` (``inspect``), ``manifest`` (provenance), ``cli``.
"""

from trtllm_dflash.convert.checkpoint import CheckpointArtifact, ConvertConfig, convert, run_convert
from trtllm_dflash.convert.loader import load_trtllm_drafter, load_trtllm_target
from trtllm_dflash.convert.quantize import QuantRecipe, quantize
from trtllm_dflash.convert.summary import inspect

__all__ = ["CheckpointArtifact", "ConvertConfig", "convert", "run_convert", "load_trtllm_target",
           "load_trtllm_drafter", "QuantRecipe", "quantize", "inspect"]
