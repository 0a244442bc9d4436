"""The served step engines (``runtime.steps``) take the in-process decoder's fast paths: the drafting plugin's kernels
for the KV injection and the draft pass, and the CUDA graphs of the verify and the draft. On the CPU the kernels run
under the Triton interpreter and the graphs rehearse (the same static forwards through the same buffers, without the
capture), so CI checks here what a GPU server runs: the same kernel calls, the same graphed steps, the same tokens."""

import asyncio
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import greedy_reference  # noqa: E402
from trtllm_dflash.plugin.dispatch import Impl  # noqa: E402
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder  # noqa: E402
from trtllm_dflash.runtime.local import BatchedLocalSteps
from trtllm_dflash.runtime.stepper import run_generation  # noqa: E402
from trtllm_dflash.runtime.protocol import GenerateRequest  # noqa: E402
from trtllm_dflash.runtime.sampling import SamplingParams  # noqa: E402
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier  # noqa: E402

pytest.importorskip("triton")

PROMPTS = [[5, 9, 11, 40], [7, 7, 1, 2, 3, 4, 5, 60, 61]]
NEW_TOKENS, BLOCK = 12, 4
TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32 kernel arithmetic (the kernel tests' tolerance, tests/plugin/test_plugin_drafter.py)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the drafting plugin's kernel entry points called (the KV injection and the block attention)."""
    from trtllm_dflash.plugin import triton_kernels

    calls = {"kv_inject": 0, "block_attention": 0}

    def counted(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(triton_kernels, "kv_inject_triton", "kv_inject")
    counted(triton_kernels, "block_attention_triton", "block_attention")
    return calls


def served(tiny_dirs, target, drafter, kernels: Impl, graphs) -> tuple[list[list[int]], list[list[int]], dict]:
    """The prompts through ``run_generation`` over batched in-process step engines built with these fast paths:
    (tokens, acceptance lengths, the engines)."""
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, len(PROMPTS), 128, BLOCK, cuda_graphs=graphs)
    injector = KVInjector(drafter, kernels)
    blocks = BlockDrafter(drafter, TargetHead(tiny_dirs["qwen3"][0], target.dtype), len(PROMPTS), 128,
                          kernels=kernels, cuda_graphs=graphs)
    steps = BatchedLocalSteps(verifier, injector, blocks)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    taus: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}

    async def one(i: int) -> None:
        async def on_update(u) -> None:
            tokens[i] = list(u.tokens)
            taus[i] += u.acceptance_lengths

        req = GenerateRequest(tuple(PROMPTS[i]), NEW_TOKENS, SamplingParams(), stop_sequences=(), stream=False)
        await run_generation(steps, req, BLOCK, i, on_update)

    async def all_of_them() -> None:
        await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    asyncio.run(all_of_them())
    return ([tokens[i] for i in range(len(PROMPTS))], [taus[i] for i in range(len(PROMPTS))],
            {"verifier": verifier, "injector": injector, "drafter": blocks})


@pytest.mark.parametrize("graphs", [False, "rehearse"])
def test_served_engines_take_the_kernel_and_graph_paths_of_the_in_process_decoder(tiny_dirs, tiny_models,
                                                                                 kernel_calls, graphs):
    target, drafter = tiny_models["qwen3"]
    ref = [list(r) for r in greedy_reference(target, PROMPTS, NEW_TOKENS)]
    dec = SpeculativeDecoder(target, drafter, BLOCK, kernels=Impl.TRITON, cuda_graphs=graphs)
    in_process = dec.generate([Request(tuple(p), NEW_TOKENS) for p in PROMPTS])
    local = dict(kernel_calls)
    assert [list(r.token_ids) for r in in_process] == ref
    assert local["kv_inject"] > 0 and local["block_attention"] > 0

    tokens, taus, engines = served(tiny_dirs, target, drafter, Impl.TRITON, graphs)
    assert tokens == ref  # lossless through the kernels (and the rehearsed graphs)
    assert engines["injector"].kernels is Impl.TRITON and engines["drafter"].kernels is Impl.TRITON
    assert kernel_calls["kv_inject"] > local["kv_inject"] and kernel_calls["block_attention"] > local["block_attention"]
    # the same drafts as the in-process kernel path: every step accepts the same lengths
    assert taus == [list(r.acceptance_lengths) for r in in_process]
    if graphs:
        assert engines["verifier"].graphs.captures > 0 and engines["drafter"].graphs.captures > 0
        assert dec.graphs.captures > 0
    else:
        assert engines["verifier"].graphs is None and engines["drafter"].graphs is None


def test_auto_picks_the_same_path_for_the_served_engines_as_for_the_decoder(tiny_dirs, tiny_models, kernel_calls):
    """On this CPU AUTO resolves to the torch code in both (the kernels are for CUDA tensors), and the served tokens
    and acceptance lengths equal the in-process decoder's."""
    target, drafter = tiny_models["qwen3"]
    dec = SpeculativeDecoder(target, drafter, BLOCK)
    in_process = dec.generate([Request(tuple(p), NEW_TOKENS) for p in PROMPTS])
    tokens, taus, engines = served(tiny_dirs, target, drafter, Impl.AUTO, False)
    assert dec.kernels is Impl.TORCH and engines["injector"].kernels is Impl.TORCH
    assert engines["drafter"].kernels is Impl.TORCH and engines["injector"].weights is None
    assert kernel_calls == {"kv_inject": 0, "block_attention": 0}
    assert tokens == [list(r.token_ids) for r in in_process]
    assert taus == [list(r.acceptance_lengths) for r in in_process]


def test_kernel_injection_equals_the_drafters_own(tiny_models):
    """The served injector's kernel K/V (rotated at each row's own positions, padded rows included) equal
    ``DrafterModel.context_kv``'s, to the kernel's float32 arithmetic (the kernel tests' tolerance)."""
    _, drafter = tiny_models["qwen3"]
    taps = torch.randn(3, 5, drafter.fc.weight.shape[1], dtype=drafter.fc.weight.dtype, generator=torch.Generator()
                       .manual_seed(0))
    starts = torch.tensor([0, 7, 30])
    k_ref, v_ref = KVInjector(drafter, Impl.TORCH).rows(taps, starts)
    k, v = KVInjector(drafter, Impl.TRITON).rows(taps, starts)
    torch.testing.assert_close(k, k_ref, **TOL)
    torch.testing.assert_close(v, v_ref, **TOL)
    one_k, one_v = KVInjector(drafter, Impl.TRITON)(taps[1], 7)
    torch.testing.assert_close(one_k, k_ref[1], **TOL)
    torch.testing.assert_close(one_v, v_ref[1], **TOL)


def test_make_repo_renders_the_graphs_into_the_step_models_that_build_them(tiny_dirs, tmp_path):
    """``make-repo --cuda-graphs``: target_verify and drafter read it back (``ModelSettings``) and build their engines
    with graphs; a backend whose engines bring their own is refused by name."""
    from trtllm_dflash.errors import ConfigError
    from trtllm_dflash.serve.settings import ModelSettings
    from trtllm_dflash.serve.triton.handlers import DrafterStepModel, TargetVerifyModel
    from trtllm_dflash.serve.triton.render import RepoConfig, config_parameters, make_repo

    tdir, ddir = map(str, tiny_dirs["qwen3"])
    repo = make_repo(RepoConfig(tdir, ddir, block_size=4, max_seq_len=64, max_sequences=2, cuda_graphs="rehearse"),
                     tmp_path / "repo")
    settings = {m: ModelSettings.from_parameters(config_parameters((repo / m / "config.pbtxt").read_text()))
                for m in ("target_verify", "drafter", "kv_inject")}
    assert settings["target_verify"].cuda_graphs == settings["drafter"].cuda_graphs == "rehearse"
    assert TargetVerifyModel(settings["target_verify"]).verifier.graphs.mode == "rehearse"
    assert DrafterStepModel(settings["drafter"]).drafter.graphs.mode == "rehearse"
    plain = make_repo(RepoConfig(tdir, ddir, block_size=4, max_seq_len=64, max_sequences=2), tmp_path / "plain")
    assert TargetVerifyModel(config_parameters((plain / "target_verify" / "config.pbtxt").read_text())) \
        .verifier.graphs is None
    with pytest.raises(ConfigError, match="--cuda-graphs"):
        RepoConfig(tdir, ddir, "trtllm-pytorch", block_size=4, max_seq_len=64, checkpoint_dir=tdir,
                   cuda_graphs="on").validate()


def test_drafter_and_kv_inject_step_models_hold_no_copy_of_the_target(tiny_dirs, tmp_path, monkeypatch):
    """The drafter step model reads the target's embedding and LM head alone (not its layers) and kv_inject nothing
    of the target, so neither process holds a copy of it; the head the drafter drafts through is the target's."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.errors import ArtifactError
    from trtllm_dflash.models import weights
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.serve.triton.handlers import DrafterStepModel, KVInjectModel
    from trtllm_dflash.serve.triton.render import RepoConfig, config_parameters, make_repo

    tdir, ddir = map(str, tiny_dirs["qwen3"])
    repo = make_repo(RepoConfig(tdir, ddir, block_size=4, max_seq_len=64, max_sequences=2), tmp_path / "repo")
    read = []
    real_read = weights.read_state_dict

    def spy(model_dir, names=None):
        state = real_read(model_dir, names)
        read.append((str(model_dir), sorted(state)))
        return state

    monkeypatch.setattr("trtllm_dflash.runtime.steps.read_state_dict", spy)
    monkeypatch.setattr(TargetModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("target loaded")))
    params = {m: config_parameters((repo / m / "config.pbtxt").read_text()) for m in ("drafter", "kv_inject")}
    served = DrafterStepModel(params["drafter"]).drafter
    KVInjectModel(params["kv_inject"])
    monkeypatch.undo()
    target, _ = load_pair(tdir, ddir)
    head = ["model.embed_tokens.weight"] + ([] if target.spec.tie_word_embeddings else ["lm_head.weight"])
    assert read == [(tdir, sorted(head))]
    assert torch.equal(served.head.lm_head, target.lm_head.weight.detach())
    with pytest.raises(ArtifactError, match="no tensor 'nope'"):
        weights.read_state_dict(tdir, ("nope",))
