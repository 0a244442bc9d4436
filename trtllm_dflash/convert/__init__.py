"""Stage 1 of the pipeline: Hugging Face target + z-lab DFlash drafter -> TensorRT-LLM-format checkpoints
(``OUT/target``, ``OUT/drafter``, ``OUT/manifest.json``), the loaders back, and ``inspect``.

Modules: ``weight_map`` (name maps as data, sharding), ``configs`` (config.json of both checkpoints, weight plans),
``checkpoint`` (``convert``), ``loader`` (round trip), ``inspect`` (summaries), ``manifest`` (provenance), ``cli``.
"""

from trtllm_dflash.convert.checkpoint import CheckpointArtifact, ConvertConfig, convert, run_convert
from trtllm_dflash.convert.loader import load_trtllm_drafter, load_trtllm_target

__all__ = ["CheckpointArtifact", "ConvertConfig", "convert", "run_convert", "load_trtllm_target",
           "load_trtllm_drafter"]
