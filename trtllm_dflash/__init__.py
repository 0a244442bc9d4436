"""trtllm-dflash: DFlash block-diffusion speculative decoding, from a PyTorch reference runtime to TensorRT-LLM engines
and a Triton Inference Server model repository.

Importing this package touches neither CUDA nor the network.
"""

__version__ = "0.1.0"
