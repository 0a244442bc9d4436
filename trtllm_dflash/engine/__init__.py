"""TensorRT-LLM engine builds (legacy ``trtllm-build`` path, TensorRT-LLM 1.2.1) and their I/O contract."""
