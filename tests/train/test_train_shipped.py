"""The shipped SmolLM2 drafter: a loadable z-lab checkpoint within the size budget, with its provenance, that the
real decoder accepts well above chance on HumanEval prompts (an acceptance-length floor, SGLang-test style)."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_dflash.assets import MASK_TOKEN_ID, SHIPPED_DRAFTER
from trtllm_dflash.specs import DrafterSpec

pytestmark = pytest.mark.skipif(not (SHIPPED_DRAFTER / "model.safetensors").is_file(), reason="no shipped drafter")

# B = 16, first 3 HumanEval prompts, 64 new tokens, greedy: the shipped drafter measures 2.221 over 86 steps; the
# earlier drafters of its training line measured 1.35-2.21 here (three prompts rank drafters poorly: some that scored
# lower here did better on all 164 HumanEval / 80 MT-Bench prompts), so the floor only catches a broken drafter
TAU_FLOOR = 1.50


def test_shipped_drafter_files_and_config():
    files = {p.name for p in SHIPPED_DRAFTER.iterdir()}
    assert {"config.json", "model.safetensors", "training_config.json", "training_log.json"} <= files
    assert (SHIPPED_DRAFTER / "model.safetensors").stat().st_size <= 25 * 2**20
    spec = DrafterSpec.load(SHIPPED_DRAFTER)
    assert spec.mask_token_id == MASK_TOKEN_ID and spec.num_target_layers == 30
    log = json.loads((SHIPPED_DRAFTER / "training_log.json").read_text())
    assert log["records"] and log["held_out"]
    # the held-out loss, not the last training record: a record averages the steps since the one before, and the
    # last one of a run can hold a single noisy batch (one run's ended at 5.10 after 4.35)
    assert log["held_out"][-1]["loss"] < log["held_out"][0]["loss"]
    for name in ("config.json", "training_config.json", "training_log.json"):  # provenance, not the trainer's machine
        text = (SHIPPED_DRAFTER / name).read_text()
        assert '"/' not in text and "gpu-machine:/work" not in text, f"{name} holds an absolute path"


@pytest.mark.slow
def test_shipped_drafter_acceptance_on_humaneval(smollm2):
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import humaneval_prompts
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    assert smollm2["drafter_trained"] and smollm2["drafter"] == str(SHIPPED_DRAFTER)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core machine: one thread is faster for these small GEMMs
    try:
        target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
        tok = load_tokenizer(smollm2["target"])
        stops = stop_token_ids(tok, target.spec.eos_token_ids)
        reqs = [Request(tuple(encode_prompt(tok, p.text, p.chat)), 64, stop_token_ids=stops)
                for p in humaneval_prompts()[:3]]
        results = SpeculativeDecoder(target, drafter, 16).generate(reqs)
    finally:
        torch.set_num_threads(before)
    taus = [t for r in results for t in r.acceptance_lengths]
    print(f"mean acceptance length {sum(taus) / len(taus):.3f} over {len(taus)} steps")
    assert sum(taus) / len(taus) >= TAU_FLOOR, taus
