"""Custom drafting ops for DFlash: KV injection, block attention and acceptance, as OpenAI Triton kernels.

Each op module (``kv_inject``, ``block_attention``, ``accept``) states its contract on a ragged batch (flat tokens plus
``cu_*`` offsets, ``ragged.RaggedBatch``), checks it, and holds the plain torch reference (the CPU path and the
kernels' oracle). ``triton_kernels`` holds the kernels and their entry points (importing it imports Triton, so
only a kernel about to run does). ``dispatch`` picks kernels on CUDA and references on CPU, and rebuilds
``DrafterModel.inject``/``draft`` on top of them; ``trt`` registers the ops with TensorRT (``tensorrt.plugin``,
namespace ``dflash``).

Import from the submodules (``from trtllm_dflash.plugin.dispatch import kv_inject``): the op modules and the
dispatch functions share names, so nothing is re-exported here.
"""
