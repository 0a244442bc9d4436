"""The runtime on the drafting plugin's kernel path (Triton interpreter on CPU) gives the oracle's tokens."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from conftest import greedy_reference  # noqa: E402
from trtllm_dflash.plugin.dispatch import Impl  # noqa: E402
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder  # noqa: E402

pytest.importorskip("triton")


@pytest.mark.parametrize("graphs", [False, "rehearse"])
@pytest.mark.parametrize("impl", [Impl.TRITON, Impl.TORCH])
def test_kernel_path_is_lossless_and_matches_the_model_path(tiny_models, impl, graphs):
    """Also through the static forwards CUDA graphs capture (``runtime.graphs``; the kernel draft's offsets made on
    the device)."""
    target, drafter = tiny_models["qwen3"]
    prompts = [[5, 9, 11, 40], [7, 7, 1, 2, 3, 4, 5, 60, 61]]
    reqs = [Request(tuple(p), 12) for p in prompts]
    ref = greedy_reference(target, prompts, 12)
    dec = SpeculativeDecoder(target, drafter, 4, kernels=impl, cuda_graphs=graphs)
    assert (dec.inject_weights is not None) == (impl is Impl.TRITON)
    out = dec.generate(reqs)
    assert [r.token_ids for r in out] == ref
    base = SpeculativeDecoder(target, drafter, 4).generate(reqs)
    assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in base]
