"""Every Triton kernel against its torch reference, run by Triton's CPU interpreter, on random ragged batches (or
compiled natively on a GPU: TRTLLM_DFLASH_TEST_DEVICE=cuda TRITON_INTERPRET=0, as perf/gpu_session.py runs them).

Batches include empty sequences, context length 0, block sizes 1 and 16 and GQA ratios 1/4/8. Float tolerances are
stated where used; token outputs must match exactly.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernels run on the CPU interpreter

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from trtllm_dflash.plugin import accept as A  # noqa: E402
from trtllm_dflash.plugin import block_attention as BA  # noqa: E402
from trtllm_dflash.plugin import kv_inject as KI  # noqa: E402
from trtllm_dflash.plugin import triton_kernels as TK  # noqa: E402
from trtllm_dflash.plugin.ragged import RaggedBatch  # noqa: E402

from conftest import on_device  # noqa: E402

# fp32 storage: kernels and references both compute in fp32 but sum in different orders (tiles, online softmax)
FP32_TOL = dict(atol=2e-5, rtol=2e-5)
# bf16 storage: the interpreter truncates fp32 -> bf16 where torch rounds to nearest, so allow 2 bf16 ulps (2^-7 rel)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def test_ragged_worked_example():
    b = RaggedBatch.make_dummy([2, 0, 3])
    assert b.cu_seqlens.tolist() == [0, 2, 2, 5] and b.max_seqlen == 3
    assert b.token_seq_ids(5).tolist() == [0, 0, 2, 2, 2]
    assert b.token_offsets(5).tolist() == [0, 1, 0, 1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# kv_inject


def _inject_case(seqlens, num_kv, head_dim, dtype, seed=0, layers=3, hidden=32, taps=2, rows_total=6, max_len=40):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w = KI.InjectWeights(
        fc=(r(hidden, taps * hidden) * 0.2).to(dtype), hidden_norm=(1 + 0.1 * r(hidden)).to(dtype),
        kv=(r(layers * 2 * num_kv * head_dim, hidden) * 0.2).to(dtype),
        k_norm=(1 + 0.1 * r(layers, head_dim)).to(dtype), eps=1e-6, num_kv_heads=num_kv, head_dim=head_dim,
    )
    batch = RaggedBatch.make_dummy(seqlens)
    x = r(batch.num_tokens, taps * hidden).to(dtype)  # [T, K·H]
    rows = torch.randperm(rows_total, generator=g)[: len(seqlens)]  # [num_seqs] distinct rows
    start = torch.randint(0, max_len - max(seqlens, default=0), (len(seqlens),), generator=g)  # [num_seqs]
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).double() / head_dim)
    f = torch.outer(torch.arange(max_len).double(), inv)
    emb = torch.cat([f, f], -1)  # [P, hd]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    shape = (layers, rows_total, max_len, num_kv, head_dim)
    return x, batch, start, rows, w, cos, sin, shape


@pytest.mark.parametrize("seqlens,num_kv,head_dim", [
    ([3, 0, 5, 1], 2, 16),  # ragged with an empty sequence
    ([16], 1, 32),  # one sequence, one kv head
    ([0, 0], 4, 16),  # nothing to inject
    ([1, 7], 3, 24),  # non-power-of-two kv heads and half head_dim (masked lanes)
])
def test_kv_inject_matches_reference(seqlens, num_kv, head_dim):
    x, batch, start, rows, w, cos, sin, shape = _inject_case(seqlens, num_kv, head_dim, torch.float32)
    caches = [torch.full(shape, 7.0) for _ in range(4)]  # sentinel: untouched slots must stay 7
    KI.kv_inject_reference(x, batch, start, rows, w, cos, sin, caches[0], caches[1])
    dev = on_device(x, batch, start, rows, w, cos, sin, caches[2], caches[3])
    TK.kv_inject_triton(*dev)
    torch.testing.assert_close(dev[7].cpu(), caches[0], **FP32_TOL)
    torch.testing.assert_close(dev[8].cpu(), caches[1], **FP32_TOL)
    written = (caches[0] != 7.0).any(-1).any(-1).sum().item()  # (layer, row, pos) slots written
    assert written == shape[0] * sum(seqlens)


def test_kv_inject_bf16_cache():
    x, batch, start, rows, w, cos, sin, shape = _inject_case([4, 0, 9], 2, 16, torch.bfloat16, seed=1)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(4)]
    KI.kv_inject_reference(x, batch, start, rows, w, cos, sin, caches[0], caches[1])
    dev = on_device(x, batch, start, rows, w, cos, sin, caches[2], caches[3])
    TK.kv_inject_triton(*dev)
    torch.testing.assert_close(dev[7].cpu().float(), caches[0].float(), **BF16_TOL)
    torch.testing.assert_close(dev[8].cpu().float(), caches[1].float(), **BF16_TOL)


# ---------------------------------------------------------------------------------------------------------------------
# block_attention


def _attn_case(block_lens, ctx_lens, num_heads, num_kv, head_dim=16, dtype=torch.float32, seed=0, rows_total=5):
    g = torch.Generator().manual_seed(seed)
    batch = RaggedBatch.make_dummy(block_lens)
    t = batch.num_tokens
    max_len = max(ctx_lens) + 1
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    kb, vb = (torch.randn(t, num_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(rows_total, max_len, num_kv, head_dim, generator=g).to(dtype) for _ in range(2))
    rows = torch.randperm(rows_total, generator=g)[: len(block_lens)]
    return q, kb, vb, kc, vc, batch, rows, torch.tensor(ctx_lens)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block", [1, 16])
def test_block_attention_gqa_and_block_sizes(group, block):
    # three sequences: normal context, context 0, and an empty one (no queries) in the middle of a batch
    case = _attn_case([block, 0, block, block], [37, 5, 0, 70], num_heads=8, num_kv=8 // group, seed=group + block)
    ref = BA.block_attention_reference(*case)
    out = TK.block_attention_triton(*on_device(case)).cpu()
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("causal,window", [(True, None), (False, 4), (True, 20), (True, 1)])
def test_block_attention_causal_and_window(causal, window):
    case = _attn_case([16, 3, 16], [50, 0, 9], num_heads=4, num_kv=1, head_dim=32, seed=3)
    ref = BA.block_attention_reference(*case, causal=causal, window=window)
    out = TK.block_attention_triton(*on_device(case), causal=causal, window=window).cpu()
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_block_attention_bf16():
    case = _attn_case([16, 0, 5], [33, 2, 0], num_heads=8, num_kv=2, head_dim=32, dtype=torch.bfloat16, seed=5)
    ref = BA.block_attention_reference(*case)
    out = TK.block_attention_triton(*on_device(case)).cpu()
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


def test_block_attention_no_mask_means_bidirectional():
    """Changing a later block key must change an earlier query's output (it would not under a causal mask)."""
    q, kb, vb, kc, vc, batch, rows, ctx = on_device(_attn_case([4], [3], num_heads=2, num_kv=2))
    before = TK.block_attention_triton(q, kb, vb, kc, vc, batch, rows, ctx)
    vb2 = vb.clone()
    vb2[3] += 1.0
    after = TK.block_attention_triton(q, kb, vb2, kc, vc, batch, rows, ctx)
    assert not torch.allclose(before[0], after[0])
    causal = TK.block_attention_triton(q, kb, vb2, kc, vc, batch, rows, ctx, causal=True)
    torch.testing.assert_close(causal[0], TK.block_attention_triton(q, kb, vb, kc, vc, batch, rows, ctx,
                                                                    causal=True)[0])


# ---------------------------------------------------------------------------------------------------------------------
# accept: exact


def _accept_case(num_drafts, vocab, seed, match_rate=0.7):
    """Random drafts; target samples copy the draft with probability match_rate so every accepted length occurs."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.zeros(len(num_drafts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(num_drafts), 0)
    drafts = torch.randint(0, vocab, (int(cu[-1]),), generator=g)
    targets = []
    for i, n in enumerate(num_drafts):
        x = torch.randint(0, vocab, (n + 1,), generator=g)
        copy = torch.rand(n, generator=g) < match_rate
        x[:n] = torch.where(copy, drafts[cu[i]: cu[i + 1]], x[:n])
        targets.append(x)
    return drafts, cu, torch.cat(targets)


def test_accept_worked_example():
    """drafts [7, 8, 9], samples [7, 8, 5, 4] -> a = 2, emitted 7, 8, 5 (runtime/sampling.py's example)."""
    d, cu, x = torch.tensor([7, 8, 9]), torch.tensor([0, 3], dtype=torch.int32), torch.tensor([7, 8, 5, 4])
    expected = A.AcceptOutput.make_dummy([[7, 8, 5]], 4)
    for fn in (A.accept_reference, TK.accept_triton):
        out = fn(*on_device(d, cu, x), 3)
        for got, want in zip((out.accepted_lengths, out.bonus_ids, out.emitted_ids),
                             (expected.accepted_lengths, expected.bonus_ids, expected.emitted_ids)):
            assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("num_drafts", [[15, 0, 15, 3, 15, 1], [0], [0, 0, 2], [1] * 7, [15] * 20])
def test_accept_matches_reference_and_runtime(num_drafts):
    from trtllm_dflash.runtime.sampling import accepted_lengths

    drafts, cu, targets = _accept_case(num_drafts, vocab=5, seed=len(num_drafts))
    width = max(num_drafts)
    ref = A.accept_reference(drafts, cu, targets, width)
    out = TK.accept_triton(*on_device(drafts, cu, targets), width)
    assert torch.equal(out.accepted_lengths.cpu(), ref.accepted_lengths)
    assert torch.equal(out.bonus_ids.cpu(), ref.bonus_ids)
    assert torch.equal(out.emitted_ids.cpu(), ref.emitted_ids)
    # the runtime's padded rule agrees wherever a batch is uniform
    for i, n in enumerate(num_drafts):
        d = drafts[cu[i]: cu[i + 1]][None]
        x = targets[cu[i] + i: cu[i + 1] + i + 1][None]
        assert int(accepted_lengths(d, x)[0]) == int(ref.accepted_lengths[i])


def test_greedy_samples_match_torch_argmax_with_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 5000, generator=g)  # V > one 4096-wide tile: ties across tiles too
    logits[1, [10, 4500]] = 100.0  # tie across tiles -> lowest index
    logits[2, [3, 7]] = 100.0  # tie inside a tile
    logits[3] = 0.0  # all equal -> 0
    logits[4, -1] = 100.0  # the last element
    assert torch.equal(TK.greedy_samples_triton(on_device(logits)).cpu(), logits.argmax(-1))


def test_inverse_cdf_matches_reference_exactly():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 5000, generator=g) * 4, -1)  # peaked, spans two tiles
    probs[0] = 0.0
    probs[0, 4999] = 1.0  # all mass on the last token
    u = torch.rand(64, generator=g)
    u[1], u[2] = 0.0, 1.0 - 2**-24  # the extreme fp32 uniforms
    ref = A.inverse_cdf_reference(probs, u)
    assert torch.equal(TK.inverse_cdf_triton(*on_device(probs, u)).cpu(), ref)
    assert ref[0] == 4999 and bool((probs.gather(1, ref[:, None]) > 0).all())
