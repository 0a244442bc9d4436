"""The tree verify in the serving loop: the topology a step model receives, the step engines' tree verify, the loop's
tree steps against the in-process decoder, make-repo --tree, and a real Triton server running it on the real pair."""

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
import torch

from conftest import greedy_reference
from trtllm_dflash.cli import main
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tree import Topology, TreeShape, tree_for
from trtllm_dflash.runtime.local import LocalSteps
from trtllm_dflash.runtime.stepper import run_generation, tree_block
from trtllm_dflash.runtime.protocol import GenerateRequest
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier, tree_topology


@pytest.mark.parametrize("shape", [TreeShape.for_block(15, datastore=True), TreeShape.for_block(3),
                                   dataclasses.replace(TreeShape.for_block(7), lookup=False)])
def test_a_topology_from_parents_is_the_shapes(shape):
    """What travels to target_verify (the parents) rebuilds the shape's layout, acceptance and paths."""
    topo = Topology(tuple(shape.parents))
    assert topo == shape.topology and topo.k == shape.k and topo.size == shape.size
    assert topo.depths == [d for _, d, _ in shape.nodes]
    lengths = torch.tensor([5, 9])
    a, b = topo.layout(lengths), shape.layout(lengths)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("positions", "slots", "allowed"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (3, shape.size), generator=g)
    preds = torch.randint(0, 4, (3, shape.size), generator=g)
    assert all(torch.equal(x, y) for x, y in zip(topo.verify(preds, tokens), shape.verify(preds, tokens)))


@pytest.mark.parametrize("parents, words", [((), "node 0"), ((1, 0), "node 0"), ((0, 0, 2), "node 2's parent 2"),
                                            ((0, -1), "node 1's parent -1")])
def test_bad_parents_are_named(parents, words):
    with pytest.raises(ValueError, match=words):
        Topology(parents)
    with pytest.raises(ConfigError, match="parents="):
        tree_topology(parents)


def _engines(tiny_dirs, tiny_models, fam, shape, rows=2):
    target, drafter = tiny_models[fam]
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, rows, 256, 16, max_tree_nodes=shape.size)
    head = TargetHead(tiny_dirs[fam][0], torch.float64)
    return LocalSteps(verifier, KVInjector(drafter), BlockDrafter(drafter, head, rows, 256))


@pytest.mark.parametrize("fam, block_size", [("qwen3", 16), ("llama", 8)])
def test_loop_tree_steps_equal_the_decoders(tiny_dirs, tiny_models, fam, block_size):
    """Over the step engines the loop's tree steps give the in-process tree decoder's tokens and step lengths (both
    the target's greedy output); sampled, the autoregressive sampled output with the same seed."""
    target, drafter = tiny_models[fam]
    shape = tree_for(block_size - 1)
    prompts = [[9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6]]
    ref = greedy_reference(target, prompts, 40)
    dec = SpeculativeDecoder(target, drafter, block_size, tree=shape).generate([Request(tuple(p), 40) for p in prompts])
    steps = _engines(tiny_dirs, tiny_models, fam, shape)
    for prompt, want, r in zip(prompts, ref, dec):
        updates = []

        async def on_update(u):
            updates.append(u)

        req = GenerateRequest(tuple(prompt), 40, SamplingParams(), (), True)
        asyncio.run(run_generation(steps, req, block_size, 3, on_update, ngram=True, tree=shape))
        taus = [t for u in updates for t in u.acceptance_lengths]
        assert updates[-1].tokens == list(want) == list(r.token_ids)
        assert taus == list(r.acceptance_lengths) and max(taus) > 1
        assert all(k == shape.k for u in updates for k in u.draft_lengths)
    assert not steps.verifier.slots.rows and not steps.drafter.slots.rows

    sampling = SamplingParams(temperature=0.9, seed=4)
    want = SpeculativeDecoder(target, None, 1).generate([Request(tuple(prompts[0]), 24, sampling=sampling)])[0]
    got = []

    async def keep(u):
        got.append(u)

    asyncio.run(run_generation(steps, GenerateRequest(tuple(prompts[0]), 24, sampling, (), False), block_size, 5,
                               keep, ngram=True, tree=shape))
    assert got[-1].tokens == list(want.token_ids)
    assert all(k == shape.k for k in got[-1].draft_lengths)


def test_a_batched_tree_verify_equals_each_row_alone(tiny_dirs, tiny_models):
    """target_verify coalesces the live sequences' tree verifies into one forward: each row's result (tokens, taps)
    and its committed cache are what verifying it alone gives."""
    shape = tree_for(7)
    prompts = [[9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6, 1]]
    results = []
    for batched in (True, False):
        steps = _engines(tiny_dirs, tiny_models, "llama", shape)
        v = steps.verifier
        blocks = []
        for s, p in enumerate(prompts):
            start = v.start(s, p, SamplingParams(), want_taps=True)
            k, vv = steps.injector(start.taps, 0)
            choices = steps.drafter.draft([s], [k], [vv], [start.first_token], 8, shape.top)[0].tolist()
            blocks.append(tree_block(shape, start.first_token, choices, tuple(p) + (start.first_token,), None))
        if batched:
            out = v.verify([0, 1], blocks, True, tuple(shape.parents))
        else:
            out = [v.verify([s], [b], True, tuple(shape.parents))[0] for s, b in enumerate(blocks)]
        rows = [v.slots.rows[s] for s in (0, 1)]
        results.append((out, [v.cache.k[:, r, : int(v.cache.lengths[r])].clone() for r in rows]))
    (batch, kb), (alone, ka) = results
    for x, y in zip(batch, alone):
        assert x.emitted == y.emitted and torch.allclose(x.taps, y.taps, atol=1e-9)
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(kb, ka))


def test_the_tree_verify_names_what_it_refuses(tiny_dirs, tiny_models):
    shape = tree_for(7)
    steps = _engines(tiny_dirs, tiny_models, "llama", tree_for(3))  # room for a k = 3 tree only
    v = steps.verifier
    v.start(1, [5, 6, 7], SamplingParams(), want_taps=False)
    with pytest.raises(ConfigError, match=f"parents='a tree of {shape.size} nodes'.*render the repository with --tree"):
        v.verify([1], [[5] * shape.size], False, tuple(shape.parents))
    small = tree_for(3)
    with pytest.raises(ConfigError, match=f"tokens=4: must hold one token per tree node \\({small.size}\\)"):
        v.verify([1], [[5] * 4], False, tuple(small.parents))


def test_make_repo_tree(tiny_dirs, tmp_path, capsys):
    """--tree: the dflash loops verify a tree, target_verify keeps room for its nodes; refused with auto, another
    backend or without prompt lookup for a datastore, each by name."""
    t, d = (str(x) for x in tiny_dirs["qwen3"])
    assert main(["make-repo", "--target", t, "--drafter", d, "--out", str(tmp_path / "r"), "--block-size", "8",
                 "--max-seq-len", "256", "--tree"]) == 0
    text = {m: (tmp_path / "r" / m / "config.pbtxt").read_text() for m in ("dflash", "dflash_bls", "baseline",
                                                                          "target_verify")}
    for model in ("dflash", "dflash_bls"):
        assert 'key: "tree" value: { string_value: "on" }' in text[model]
    assert 'key: "tree" value: { string_value: "off" }' in text["baseline"]
    assert f'key: "max_tree_nodes" value: {{ string_value: "{tree_for(7).size}" }}' in text["target_verify"]
    capsys.readouterr()
    assert main(["make-repo", "--target", t, "--drafter", d, "--out", str(tmp_path / "ra"), "--block-size", "auto",
                 "--max-seq-len", "256", "--tree"]) == 0  # auto: the tree of its longest block is one of its options
    assert f'"{tree_for(15).size}"' in (tmp_path / "ra" / "target_verify" / "config.pbtxt").read_text()
    capsys.readouterr()
    for flags, words in ((["--tree", "--backend", "trtllm-engine", "--engines", str(tmp_path)],
                          "--tree=True: runs in the BLS loop over the torch step models"),
                         (["--tree", "--no-ngram", "--datastore", str(tmp_path / "x.safetensors")],
                          "--datastore=.*proposes for the tree's lookup chains only"),
                         (["--tree", "--datastore", str(tmp_path / "x.safetensors")], "x.safetensors: missing")):
        assert main(["make-repo", "--target", t, "--drafter", d, "--out", str(tmp_path / "r2"), "--max-seq-len", "256",
                     *flags]) == 2
        assert __import__("re").search(words, capsys.readouterr().err), flags


# --- a real Triton server on the real pair ----------------------------------------------------------------------

PROMPTS = ["def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"", "Write a haiku about rain.",
           "List three prime numbers.", "What is the capital of Italy?"]


@pytest.fixture(scope="module")
def tree_server(smollm2, tmp_path_factory):
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer
    from trtllm_dflash.specs import DrafterSpec

    # the datastore and the draft vocabulary by default (auto), as make_decoder and load_pair apply them in-process
    cfg = RepoConfig(smollm2["target"], smollm2["drafter"], block_size=16, max_seq_len=512, max_sequences=8,
                     ngram=True, tree=True, trtllm_names=False)
    assert cfg.datastore_file() and cfg.draft_vocab_file(DrafterSpec.load(smollm2["drafter"])), \
        "the shipped drafter has a datastore and a draft vocabulary"
    repo = make_repo(cfg, tmp_path_factory.mktemp("repo") / "repo")
    with TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.mark.slow
def test_triton_tree_equals_the_in_process_tree(tree_server, smollm2):
    """Through the real server (gRPC streams, coalesced tree verifies of concurrent sequences) the tree repository's
    output and every step's length are the in-process tree decoder's with the same datastore, and the target's
    greedy output; a sampled request gives the autoregressive sampled output with its seed; a malformed tree is
    refused by name and the server goes on."""
    pytest.importorskip("tritonclient.grpc")
    import tritonclient.grpc as grpcclient

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    reqs = [Request(tuple(encode_prompt(tok, p, chat=True)), 32, stop_token_ids=stops) for p in PROMPTS]
    tree = make_decoder(target, drafter, DecodeMode(16, ngram=True, tree=True), smollm2["drafter"]).generate(reqs)
    greedy = SpeculativeDecoder(target, None, 1).generate(reqs)
    assert [r.token_ids for r in tree] == [r.token_ids for r in greedy]
    with DFlashClient(tree_server.grpc_url) as client:
        done = client.generate("dflash", GenerateParams(PROMPTS[0], 32))
        assert done.token_ids == list(tree[0].token_ids)
        assert done.acceptance_lengths == list(tree[0].acceptance_lengths) and max(done.acceptance_lengths) > 4
        rids = [client.submit("dflash", GenerateParams(p, 32)) for p in PROMPTS]
        finals = {}

        def drain(rid):
            finals[rid] = list(client.responses(rid))[-1]

        threads = [threading.Thread(target=drain, args=(r,)) for r in rids]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
        for rid, r in zip(rids, tree):
            assert finals[rid].output_ids == list(r.token_ids)
        sampled = client.generate("dflash", GenerateParams(PROMPTS[1], 16, temperature=0.8, seed=2))
        want = SpeculativeDecoder(target, None, 1).generate([dataclasses.replace(
            reqs[1], max_new_tokens=16, sampling=SamplingParams(temperature=0.8, seed=2))])[0]
        assert sampled.token_ids == list(want.token_ids)

    c = grpcclient.InferenceServerClient(tree_server.grpc_url)
    inputs = []
    for name, arr, dtype in (("mode", np.array([[1]], np.int32), "INT32"), ("seq_id", np.array([[77]], np.uint64),
                             "UINT64"), ("tokens", np.array([[1, 2, 3]], np.int32), "INT32"),
                             ("parents", np.array([[0, 0, 5]], np.int32), "INT32")):
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    with pytest.raises(Exception) as exc:
        c.infer("target_verify", inputs)
    assert "INVALID_ARGUMENT" in str(exc.value.status()) and "parents=" in str(exc.value)
    with DFlashClient(tree_server.grpc_url) as client:
        assert client.generate("baseline", GenerateParams("Say yes.", 4)).token_ids


@pytest.mark.parametrize("flat", [True, False])
def test_loop_auto_with_a_tree_is_lossless(tiny_dirs, tiny_models, flat):
    """The serving loop under --block-size auto with a tree: a tree step where the cost model says a wide verify is
    cheap (flat), none where it costs in proportion to its width; the output is the target's greedy either way."""
    from conftest import tree_policy as _policy

    target, _ = tiny_models["qwen3"]
    shape = tree_for(15)
    policy = _policy(flat, shape)
    policy.tree_nodes = 0  # the loop gives the policy its tree
    steps = _engines(tiny_dirs, tiny_models, "qwen3", shape)
    prompt = [9, 8, 7, 9, 8, 7, 9, 8]
    want = greedy_reference(target, [prompt], 40)[0]
    updates = []

    async def on_update(u):
        updates.append(u)

    asyncio.run(run_generation(steps, GenerateRequest(tuple(prompt), 40, SamplingParams(), (), False), "auto", 3,
                               on_update, policy=policy, ngram=True, tree=shape))
    assert updates[-1].tokens == list(want) and policy.tree_nodes == shape.size
    assert (policy.telemetry.tree_steps >= 1) if flat else policy.telemetry.tree_steps == 0


@pytest.mark.slow
def test_triton_auto_with_a_tree_is_lossless(smollm2, tmp_path):
    """make-repo --block-size auto --tree served by a real Triton server on the real pair: greedy-identical output."""
    pytest.importorskip("tritonclient.grpc")
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size="auto", max_seq_len=512,
                                max_sequences=4, ngram=True, tree=True, trtllm_names=False), tmp_path / "repo")
    target, _ = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    greedy = SpeculativeDecoder(target, None, 1).generate(
        [Request(tuple(encode_prompt(tok, p, chat=True)), 32, stop_token_ids=stops) for p in PROMPTS[:2]])
    with TritonServer(repo, log_path=tmp_path / "server.log") as server, DFlashClient(server.grpc_url) as client:
        for prompt, want in zip(PROMPTS[:2], greedy):
            assert client.generate("dflash", GenerateParams(prompt, 32)).token_ids == list(want.token_ids)
