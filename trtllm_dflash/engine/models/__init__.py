"""Model classes that ``trtllm-build --model_cls_file`` loads inside NVIDIA's TensorRT-LLM container. They import
``tensorrt_llm`` at module top, so nothing in this package imports them; tests check them as source (ast)."""
