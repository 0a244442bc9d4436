"""The retrieval datastore (runtime.datastore): proposals by hand, save/load, the ``datastore`` command, its share
of the tree's lookup chains, and decoding with it lossless on tiny models."""

import json

import numpy as np
import pytest
import torch

from conftest import greedy_reference
from trtllm_dflash.cli import main as cli
from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.runtime.datastore import NGRAMS, Datastore, hash_windows, tail_hashes
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.tree import TreeShape, lookup_chains


def test_proposals_follow_the_longest_matching_tail_and_the_most_common_continuations():
    store = Datastore.from_sequences([
        [1, 2, 3, 4, 5],
        [1, 2, 3, 4, 6],
        [9, 2, 3, 4, 6, 7],
        [8, 3, 4, 5, 9],
        [3, 4, 7],
    ])
    assert store.meta == {"num_sequences": 5, "num_tokens": 24} and store.num_tokens == 24
    # the tail (2 3 4) occurs 3 times: 6 follows twice, 5 once; then after 6, 7 (once; the other sequence ends)
    assert store.propose([7, 2, 3, 4], 3, 2) == [[6, 7], [5]]
    # (3 4) alone occurs 5 times: 5 and 6 twice each (a tie: the smaller id first), 7 once
    assert store.propose([0, 3, 4], 2, 3) == [[5, 9], [6, 7], [7]]
    assert store.propose([1, 2, 3, 4, 5], 4, 2) == [[9]]  # the longest tail (3 4 5, in sequence 4) wins over (5)
    assert store.propose([5, 5], 4, 2) == [] and store.propose([4], 4, 2) == []  # no tail of 2+ tokens recurs
    assert store.propose([2, 3, 4], 3, 0) == []
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        store.propose([2, 3, 4], 65, 1)


def test_a_context_tail_hashes_as_the_index_hashes_its_windows():
    g = np.random.default_rng(0)
    for size in (1, 3, max(NGRAMS), 40):
        context = g.integers(0, 49152, size).tolist()
        keys = tail_hashes(context)
        assert len(keys) == min(size, max(NGRAMS))
        for n in range(1, len(keys) + 1):
            assert keys[n - 1] == hash_windows(np.asarray(context[-n:]), n)[0][0]


def test_save_and_load_keep_the_tokens(tmp_path):
    small = Datastore.from_sequences([[1, 2, 3], [4, 5]], {"note": "x"})
    small.save(tmp_path / "small.safetensors")
    back = Datastore.load(tmp_path / "small.safetensors")
    assert back.tokens.tolist() == [1, 2, 3, -1, 4, 5, -1] and back.meta == small.meta
    big = Datastore.from_sequences([[70_000, 2, 70_000, 2, 5]])  # ids past uint16: stored as int32
    big.save(tmp_path / "big.safetensors")
    back = Datastore.load(tmp_path / "big.safetensors")
    assert back.tokens.tolist() == [70_000, 2, 70_000, 2, 5, -1]
    assert back.propose([70_000, 2], 2, 2) == [[5], [70_000, 2]]  # one each: the smaller id first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    with pytest.raises(ArtifactError, match="no such datastore file"):
        Datastore.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ArtifactError, match="unreadable"):
        Datastore.load(tmp_path / "junk.safetensors")
    from safetensors.numpy import save_file

    save_file({"weights": np.zeros(3, dtype=np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ArtifactError, match="not a trtllm-dflash datastore"):
        Datastore.load(tmp_path / "other.safetensors")


def test_the_datastore_command_indexes_regen_shards(tmp_path, capsys):
    from trtllm_dflash.train.regen import Regenerated, write_regen_shard

    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "meta.json").write_text(json.dumps({"pool": "p.jsonl", "num_prompts": 2}))
    for i, seqs in enumerate(([[1, 2, 3, 4], [5, 6, 7]], [[1, 2, 3, 9]])):
        write_regen_shard(regen / f"regen-{i:05d}.safetensors", [
            Regenerated(torch.tensor(s), 1, torch.zeros(len(s), 2, dtype=torch.int32),
                        torch.zeros(len(s), 2, dtype=torch.bfloat16)) for s in seqs])
    out = tmp_path / "datastore.dflash"
    assert cli(["datastore", "--from", str(regen), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["num_sequences"] == 3 and printed["num_tokens"] == 11 and printed["num_shards"] == 2
    store = Datastore.load(out)
    assert store.meta["regen_meta"] == [{"pool": "p.jsonl", "num_prompts": 2}]
    assert store.propose([1, 2, 3], 2, 2) == [[4], [9]]
    assert cli(["datastore", "--from", str(regen), "--out", str(out), "--max-tokens", "4"]) == 0
    assert Datastore.load(out).num_tokens == 4  # stops adding sequences once it holds 4 tokens
    assert cli(["datastore", "--from", str(tmp_path / "nothing"), "--out", str(out)]) == 2  # no shards there
    assert "holds no regen shards" in capsys.readouterr().err


def test_the_datastore_takes_half_of_the_lookup_chains_and_fills_what_lookup_leaves():
    shape = TreeShape(3, lookup=3)
    # the store after (4 5): 7 twice (then 7 or 1: a tie, the smaller id), 8 once
    store = Datastore.from_sequences([[4, 5, 8, 8, 8], [4, 5, 7, 7], [4, 5, 7, 1]])
    assert store.propose([4, 5], 3, 3) == [[7, 1], [8, 8, 8]]
    context = [4, 5, 6, 6, 6, 5, 1, 2, 4, 5]  # prompt lookup: after (4 5) came 6 6 6, after (5) also 1 2 4
    assert lookup_chains(shape, context) == [[6, 6, 6], [1, 2, 4]]
    # prompt lookup's 2 (half of 3 chains, rounded up), then the store's best
    assert lookup_chains(shape, context, store) == [[6, 6, 6], [1, 2, 4], [7, 1]]
    # where prompt lookup has less, the store fills the chains it leaves; where it has nothing, all of them
    assert lookup_chains(shape, [4, 5, 6, 6, 6, 1, 4, 5]) == [[6, 6, 6]]
    assert lookup_chains(shape, [4, 5, 6, 6, 6, 1, 4, 5], store) == [[6, 6, 6], [7, 1], [8, 8, 8]]
    assert lookup_chains(shape, [9, 4, 5], store) == [[7, 1], [8, 8, 8]]
    # a proposal an earlier one starts with is skipped
    assert lookup_chains(shape, [4, 5, 7, 7, 2, 9, 4, 5], Datastore.from_sequences([[4, 5, 7, 7]])) == [[7, 7, 2]]
    assert lookup_chains(TreeShape(3, lookup=0), context, store) == []


@pytest.mark.parametrize("block_size", [4, 16])
def test_decoding_with_a_datastore_is_lossless(tiny_models, block_size):
    """A datastore holding the target's own greedy outputs proposes what it will say (a later prompt shares an
    earlier one's start), one of random sequences proposes nonsense: either way the output is the target's greedy
    output, and the first makes steps longer."""
    target, drafter = tiny_models["qwen3"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 12, 5)]
    ref = greedy_reference(target, prompts, 32)
    reqs = [Request(tuple(p), 32) for p in prompts]
    truthful = Datastore.from_sequences(list(p) + list(r) for p, r in zip(prompts, ref))
    noise = Datastore.from_sequences(torch.randint(3, 256, (40, 30), generator=g).tolist())
    plain = SpeculativeDecoder(target, drafter, block_size, tree=True).generate(reqs)
    for store in (truthful, noise):
        dec = SpeculativeDecoder(target, drafter, block_size, tree=True, datastore=store)
        assert dec.tree == TreeShape.for_block(block_size - 1, datastore=True)
        out = dec.generate(reqs)
        assert [r.token_ids for r in out] == ref
    told = [t for r in SpeculativeDecoder(target, drafter, block_size, tree=True, datastore=truthful).generate(reqs)
            for t in r.acceptance_lengths]
    assert len(told) < sum(len(r.acceptance_lengths) for r in plain)  # fewer, longer steps


def test_a_datastore_needs_the_tree_with_lookup(tiny_models):
    target, drafter = tiny_models["llama"]
    store = Datastore.from_sequences([[1, 2, 3]])
    with pytest.raises(ConfigError, match="lookup chains only"):
        SpeculativeDecoder(target, drafter, 8, datastore=store)
    with pytest.raises(ConfigError, match="lookup chains only"):
        SpeculativeDecoder(target, drafter, 8, tree=TreeShape(7, lookup=0), datastore=store)


def test_a_repository_config_proposes_from_what_make_decoder_proposes_from(tmp_path):
    """``RepoConfig`` built in code defaults to ``datastore="auto"`` as ``make-repo`` and ``make_decoder`` do: the
    drafter directory's datastore where the tree has lookup chains (tree and ngram), none otherwise; "none" names none
    anywhere, an explicit file is kept; the rendered tree takes the datastore's chains exactly when a file is named."""
    from conftest import make_tiny_pair
    from trtllm_dflash.commands.common import resolve_datastore
    from trtllm_dflash.runtime.datastore import DATASTORE_FILE
    from trtllm_dflash.serve.triton.render import RepoConfig
    from trtllm_dflash.specs import DrafterSpec

    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=2, block_size=8)
    Datastore.from_sequences([[1, 2, 3, 4, 5]]).save(ddir / DATASTORE_FILE)
    spec, stored = DrafterSpec.load(ddir), str((ddir / DATASTORE_FILE).resolve())

    def cfg(**kw):
        return RepoConfig(str(tdir), str(ddir), block_size=8, max_seq_len=64, max_sequences=2, **kw)

    tree = cfg(tree=True, ngram=True)
    assert tree.datastore_file() == stored and resolve_datastore("auto", ddir, True) is not None
    assert tree.values(spec)["dflash"]["datastore"] == stored
    assert tree.tree_shape(spec) == TreeShape.for_block(7, datastore=True)
    for off in (cfg(tree=True), cfg(ngram=True), cfg(tree=True, ngram=True, datastore="none")):
        assert off.datastore_file() == "" and off.values(spec)["dflash"]["datastore"] == ""
    assert cfg(tree=True, ngram=True, datastore="none").tree_shape(spec) == TreeShape.for_block(7)
    explicit = cfg(tree=True, ngram=True, datastore=str(ddir / DATASTORE_FILE))
    assert explicit.datastore_file() == stored
    with pytest.raises(ConfigError, match="--datastore=.*proposes for the tree's lookup chains only"):
        cfg(tree=True, datastore=str(ddir / DATASTORE_FILE)).validate()
