"""Custom drafting ops for DFlash: KV injection, block attention and acceptance, as OpenAI Triton kernels.

Each op has a plain torch reference (the CPU path and the kernels' oracle) and a ragged-batch API (flat tokens plus
``cu_*`` offsets, ``ragged.RaggedBatch``). ``dispatch`` picks kernels on CUDA and references on CPU;
``drafter_ops`` rebuilds ``DrafterModel.inject``/``draft`` on top of them; ``trt`` registers the ops with TensorRT
(``tensorrt.plugin``, namespace ``dflash``). Triton itself is an optional dependency, imported only by
``triton_kernels`` and only when a kernel actually runs.

Import from the submodules (``from trtllm_dflash.plugin.dispatch import kv_inject``): the op modules and the
dispatch functions share names, so nothing is re-exported here.
"""
