"""The DFlash training objective against hand-built masks and against the inference path itself."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.train.data import Sample
from trtllm_dflash.train.objective import block_visibility, collate, dflash_loss, drafter_blocks, sample_anchors
from tests.conftest import make_tiny_pair


def test_block_visibility_matches_hand_built_mask():
    """Two blocks (B = 3) anchored at 2 and 4 over a 5-token context; keys are [ctx 0..4 ; own block 0..2].

    Anchor 2: context 0, 1 (strictly before the anchor: its own taps at 2 do not exist at inference), all 3 own slots.
    Anchor 4: context 0..3. A block's other keys (the other block) are not even in its key list.
    """
    got = block_visibility(torch.tensor([2, 4]), ctx_len=5, block_size=3, causal=False)
    row_a = [1, 1, 0, 0, 0, 1, 1, 1]
    row_b = [1, 1, 1, 1, 0, 1, 1, 1]
    want = torch.tensor([[row_a] * 3, [row_b] * 3], dtype=torch.bool)
    assert torch.equal(got, want)
    causal = block_visibility(torch.tensor([2]), ctx_len=5, block_size=3, causal=True)
    assert causal[0].int().tolist() == [[1, 1, 0, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1, 1]]


def test_anchors_lie_in_the_response_with_a_next_token():
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=5, seq_len=12, num_anchors=4, generator=g)
    assert len(a) == 4 and len(set(a.tolist())) == 4 and int(a.min()) >= 5 and int(a.max()) <= 10
    assert sample_anchors(5, 8, 10, g).tolist() == [5, 6]  # fewer candidates than asked: all of them


def test_training_blocks_equal_inference_draft_steps(tmp_path):
    """Each training block anchored at p == an inference draft after committing p tokens (inject + draft)."""
    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=3, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    s = 14
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (s,), generator=gen)
    with torch.no_grad():
        cache = target.new_cache(1, s + 4)
        _, taps = target(ids[None], cache, tap_layers=drafter.spec.target_layer_ids)  # [1, S, K·H]
    samples = [Sample(ids, taps[0], prompt_len=3), Sample(ids[:10], taps[0, :10], prompt_len=3)]
    anchors = [torch.tensor([3, 7, 12]), torch.tensor([5])]
    batch = collate(samples, anchors, "cpu", dtype=torch.float64)
    with torch.no_grad():
        train_h = drafter_blocks(drafter, target.embed, batch)  # [2·3, B, H]
    for row, (i, p) in enumerate([(0, 3), (0, 7), (0, 12), (1, 5)]):
        row = row if i == 0 else 3
        dcache = drafter.new_cache(1, s + 8)
        drafter.inject(taps[:, :p], torch.tensor([p]), dcache)
        block = torch.full((1, 4), drafter.spec.mask_token_id)
        block[0, 0] = ids[p]
        with torch.no_grad():
            ref = drafter.draft(target.embed(block), dcache)[0]  # [B, H]
        # float64 end to end (casts only widen); the two paths pad keys differently, which only reorders sums.
        torch.testing.assert_close(train_h[row], ref, rtol=0, atol=1e-10)


def test_loss_falls_on_a_tiny_target(tmp_path):
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    target, _ = load_pair(tdir, ddir)
    drafter = DrafterModel.from_pretrained(ddir).requires_grad_(True).train()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (20,), generator=gen) for _ in range(2)]
    with torch.no_grad():
        samples = []
        for ids in seqs:
            _, taps = target(ids[None], target.new_cache(1, 24), tap_layers=drafter.spec.target_layer_ids)
            samples.append(Sample(ids, taps[0], prompt_len=4))
    anchors = [torch.arange(4, 18, 2)] * 2
    batch = collate(samples, anchors, "cpu")
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        m = dflash_loss(drafter, target.embed, target.lm_head, batch, gamma=2.0)
        opt.zero_grad()
        m.loss.backward()
        opt.step()
        losses.append(float(m.loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(p.grad is None for p in target.parameters())  # the target stays frozen


def test_tap_standardisation_folds_into_fc(tmp_path):
    """Training on standardised taps with weight W == the exported drafter (W · scale) on raw taps."""
    from trtllm_dflash.train.objective import tap_standardizer
    from trtllm_dflash.train.trainer import exported_state

    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, taps = target(ids[None], target.new_cache(1, 20), tap_layers=drafter.spec.target_layer_ids)
    taps[0, :, 3] *= 1000.0  # a "massive activation" channel
    samples = [Sample(ids, taps[0], prompt_len=2)]
    scale = tap_standardizer(samples).double()
    assert scale[3] < 1e-2 * scale[4]
    anchors = [torch.tensor([2, 6, 11])]
    exported = DrafterModel(drafter.spec, dtype=torch.float64)
    exported.load_state_dict(exported_state(drafter, scale))
    with torch.no_grad():
        trained_view = drafter_blocks(drafter, target.embed, collate(samples, anchors, "cpu", torch.float64, scale))
        shipped_view = drafter_blocks(exported, target.embed, collate(samples, anchors, "cpu", torch.float64))
    torch.testing.assert_close(trained_view, shipped_view)


def test_init_from_target_copies_the_layers_after_the_first_tap(tmp_path):
    """Drafter layer i <- target layer first_tap + 1 + i; fc passes the first tap through (undoing the standardiser)."""
    from trtllm_dflash.train.init import init_from_target
    from trtllm_dflash.train.objective import tap_standardizer

    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    target, drafter = load_pair(tdir, ddir)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, taps = target(ids[None], target.new_cache(1, 12), tap_layers=drafter.spec.target_layer_ids)
    scale = tap_standardizer([Sample(ids, taps[0], prompt_len=2)])
    state = init_from_target(drafter.state_dict(), target, drafter.spec, scale, ids)
    first = drafter.spec.target_layer_ids[0]
    src = target.model.layers[first + 1]
    assert torch.equal(state["layers.0.self_attn.k_proj.weight"], src.self_attn.k_proj.weight)
    assert torch.equal(state["hidden_norm.weight"], src.input_layernorm.weight)
    h = drafter.spec.hidden_size
    x = taps[0, :, :] * scale
    torch.testing.assert_close(x @ state["fc.weight"].T, taps[0, :, :h], rtol=1e-5, atol=1e-5)
    drafter.load_state_dict(state)  # every key present, every shape right


def test_packed_block_attention_equals_the_per_block_copy(tmp_path):
    """The packed formulation (one context K/V per sequence) gives the reference's hidden states and gradients, with
    padding anchors, a causal layer and a sliding-window layer in the mix."""
    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=4, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    spec = drafter.spec
    from dataclasses import replace

    from trtllm_dflash.specs import LayerType

    for layer_types, causal in [(spec.layer_types, spec.layer_causal),
                                ((LayerType.SLIDING,) + spec.layer_types[1:], (True,) + spec.layer_causal[1:])]:
        d = DrafterModel(replace(spec, layer_types=layer_types, layer_causal=causal, sliding_window=5),
                         dtype=torch.float64)
        d.load_state_dict(drafter.state_dict())
        gen = torch.Generator().manual_seed(3)
        samples = []
        with torch.no_grad():
            for s in (18, 11):
                ids = torch.randint(0, 256, (s,), generator=gen)
                _, taps = target(ids[None], target.new_cache(1, s), tap_layers=spec.target_layer_ids)
                samples.append(Sample(ids, taps[0], prompt_len=2))
        batch = collate(samples, [torch.tensor([2, 5, 9, 15]), torch.tensor([3, 8])], "cpu", dtype=torch.float64)
        outs = []
        for packed in (False, True):
            d.zero_grad()
            m = dflash_loss(d, target.embed, target.lm_head, batch, gamma=2.0, packed=packed)
            m.loss.backward()
            outs.append((drafter_blocks(d, target.embed, batch, packed).detach(), m.loss.detach(),
                         [p.grad.clone() for p in d.parameters()]))
        torch.testing.assert_close(outs[1][0], outs[0][0])
        torch.testing.assert_close(outs[1][1], outs[0][1])
        for g_packed, g_ref in zip(outs[1][2], outs[0][2]):
            torch.testing.assert_close(g_packed, g_ref)


def _tiny_target_logits(tmp_path):
    """A tiny float64 pair, 14 random ids, the target's taps over them and its logits [S, V] (row j predicts j + 1)."""
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=5, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden, taps = target(ids[None], target.new_cache(1, 14), tap_layers=drafter.spec.target_layer_ids)
        t_logits = target.logits(hidden)[0]  # [S, V]: row j predicts token j + 1
    return target, drafter, ids, taps, t_logits


def test_self_distillation_loss_against_the_targets_own_distribution(tmp_path):
    """distill = 1 with the full distribution stored (k = V) is the cross-entropy to the target's softmax; distill = 0
    is the hard-label loss; the mix is linear."""
    target, drafter, ids, taps, t_logits = _tiny_target_logits(tmp_path)
    top = t_logits.topk(256, dim=-1)
    sample = Sample(ids, taps[0], 3, top.indices.int(), top.values)
    batch = collate([sample], [torch.tensor([3, 6, 9])], "cpu", dtype=torch.float64)
    losses = {w: float(dflash_loss(drafter, target.embed, target.lm_head, batch, 2.0, distill=w).loss) for w in (0, 0.5, 1)}
    with torch.no_grad():
        h = drafter_blocks(drafter, target.embed, batch)[:, 1:]  # [3, B − 1, H]
        logq = torch.log_softmax(target.lm_head(h).double(), dim=-1)
    pos = torch.tensor([3, 6, 9])[:, None] + torch.arange(1, 4)  # label positions
    p = torch.softmax(t_logits[pos - 1].double(), dim=-1)
    ce = -(p * logq).sum(-1)
    w = torch.exp(-(torch.arange(1, 4, dtype=torch.float64) - 1) / 2.0).expand(3, 3)
    assert abs(losses[1] - float((ce * w).sum() / w.sum())) < 1e-6
    assert abs(losses[0.5] - (losses[0] + losses[1]) / 2) < 1e-6


def test_total_variation_loss_against_the_targets_own_distribution(tmp_path):
    """tv = 1 with the full distribution stored (k = V) is ½ Σ |p − q| against the target's softmax; with only the
    top-k stored the mass q puts outside it counts in full; the mix with the hard labels is linear, and the term's
    gradient reaches the drafter."""
    target, drafter, ids, taps, t_logits = _tiny_target_logits(tmp_path)
    pos = torch.tensor([3, 6, 9])[:, None] + torch.arange(1, 4)  # label positions
    w = torch.exp(-(torch.arange(1, 4, dtype=torch.float64) - 1) / 2.0).expand(3, 3)
    for k in (256, 5):
        top = t_logits.topk(k, dim=-1)
        batch = collate([Sample(ids, taps[0], 3, top.indices.int(), top.values)], [torch.tensor([3, 6, 9])], "cpu",
                        dtype=torch.float64)
        losses = {t: float(dflash_loss(drafter, target.embed, target.lm_head, batch, 2.0, tv=t).loss)
                  for t in (0, 0.5, 1)}
        with torch.no_grad():
            h_ref = drafter_blocks(drafter, target.embed, batch)[:, 1:]  # [3, B − 1, H]
            q = torch.softmax(target.lm_head(h_ref).double(), dim=-1)  # [3, B − 1, V]
        p = torch.zeros_like(q)
        rows = pos - 1
        p.scatter_(-1, top.indices[rows].long(), torch.softmax(top.values[rows].double(), dim=-1))
        tv = 0.5 * (p - q).abs().sum(-1)  # exact TV against the (renormalised top-k) target distribution
        assert abs(losses[1] - float((tv * w).sum() / w.sum())) < 1e-6  # the loss reads the logits in float32
        assert abs(losses[0.5] - (losses[0] + losses[1]) / 2) < 1e-6
    drafter.requires_grad_(True)  # load_pair returns it frozen, for inference
    dflash_loss(drafter, target.embed, target.lm_head, batch, 2.0, tv=0.9).loss.backward()
    grads = [p_.grad for p_ in drafter.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)

def test_a_time_box_advances_the_lr_schedule_with_the_clock():
    from trtllm_dflash.train.trainer import lr_at, scheduled_step

    # no deadline: the step alone
    assert scheduled_step(10, 0, 1000, t0=0.0, deadline=None, now=5.0) == 10
    # half the box gone after 10 of 1000 steps: the schedule is half-way, and at the deadline on its last step
    assert scheduled_step(10, 0, 1000, t0=0.0, deadline=100.0, now=50.0) == 500
    assert scheduled_step(10, 0, 1000, t0=0.0, deadline=100.0, now=150.0) == 999
    # steps ahead of the clock keep their place; a resumed run spreads the steps left over its own box
    assert scheduled_step(800, 0, 1000, t0=0.0, deadline=100.0, now=50.0) == 800
    assert scheduled_step(600, 600, 1000, t0=0.0, deadline=100.0, now=50.0) == 800
    # so a run cut short by its box still ends at the bottom of the cosine (10 % of the peak)
    assert lr_at(scheduled_step(10, 0, 1000, 0.0, 100.0, 100.0), 1000, 1.0, 0.02) < 0.11


def test_collate_scales_host_taps_on_the_training_device():
    """Taps from disk live on the host while the tap scale lives on the training device: the first GPU run failed at
    its first step on exactly that. Online taps (``with_taps``) live on the device and are gathered there. The meta
    device stands in for a GPU here."""
    samples = [Sample(torch.arange(12), torch.randn(12, 6), prompt_len=3),
               Sample(torch.arange(9), torch.randn(9, 6), prompt_len=2)]
    anchors = [torch.tensor([3, 7]), torch.tensor([2])]
    batch = collate(samples, anchors, "meta", tap_scale=torch.full((6,), 0.5, device="meta"))
    assert batch.taps.device.type == "meta" and batch.ids.device.type == "meta"
    assert batch.ctx_len == 7  # the last anchor, known without reading the device
    ref = collate(samples, anchors, "cpu", tap_scale=torch.full((6,), 0.5))
    assert torch.equal(ref.taps[0, :12], samples[0].taps * 0.5)
    on_device = [Sample(x.ids, x.taps.to("meta"), x.prompt_len) for x in samples]
    batch = collate(on_device, anchors, "meta", tap_scale=torch.full((6,), 0.5, device="meta"))
    assert batch.taps.device.type == "meta" and batch.taps.shape == ref.taps.shape


class HostReads(TorchFunctionMode):
    """Records every read of a tensor's value into Python (``item``, ``float(t)``, ``bool(t)``, ``tolist``, a boolean
    mask...) as (what, the tensor's id), and every blocking copy from the host to another device (``to`` without
    ``non_blocking``): on a GPU each waits for all the kernels launched so far."""

    READS = {"__bool__", "__float__", "__int__", "__index__", "item", "tolist", "nonzero", "numpy", "masked_select"}

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in self.READS or (name == "__getitem__" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))):
            self.reads.append((name, id(args[0])))
        if name == "to" and args[0].device.type == "cpu" and not (kwargs or {}).get("non_blocking"):
            dest = [torch.device(a) for a in (*args[1:], (kwargs or {}).get("device"))
                    if isinstance(a, (str, torch.device))]
            if dest and dest[0].type != "cpu":
                self.reads.append(("blocking copy", id(args[0])))
        return func(*args, **(kwargs or {}))

    def device_reads(self, host: set[int]) -> list[str]:
        """The reads of tensors other than ``host`` (ids of tensors that live on the host on a GPU too)."""
        return [name for name, t in self.reads if t not in host]


def test_a_training_step_reads_nothing_back_from_the_device(tmp_path):
    """Loss, backward, clipping, the optimizer step and the step's log entry queue on the device without a read:
    the host can launch the next step while the device still runs this one (``trainer.train`` reads a window of
    steps at once, ``window_record``). The taps of the online path (``with_taps``) stay where the target runs."""
    from trtllm_dflash.train.regen import with_taps
    from trtllm_dflash.train.trainer import window_entry, window_record

    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=4, block_size=4)
    target, _ = load_pair(tdir, ddir)
    drafter = DrafterModel.from_pretrained(ddir).requires_grad_(True).train()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(6, 200, (n,), generator=g) for n in (20, 13)]
    with HostReads() as mode:
        samples = with_taps(target, [Sample(ids, None, prompt_len=4) for ids in seqs], drafter.spec.target_layer_ids)
    assert mode.device_reads(set()) == []  # the static forward: no cache length read back
    assert samples[0].taps.device == target.device and samples[0].taps.dtype == torch.bfloat16
    with torch.no_grad():  # the same taps as the dynamic forward over the same keys
        _, taps = target(torch.stack([seqs[0][:-1]]), target.new_cache(1, 20), tap_layers=drafter.spec.target_layer_ids)
    assert torch.equal(samples[0].taps[:-1], taps[0].to(torch.bfloat16))
    anchors = [sample_anchors(s.prompt_len, len(s.ids), 8, g) for s in samples]
    with HostReads() as mode:
        collate(samples, anchors, "meta", tap_scale=torch.ones(samples[0].taps.shape[1], device="meta"))
    # host tensors reach the device without a blocking copy (its reads are of the host's anchors: the context width)
    assert "blocking copy" not in mode.device_reads(set())
    batch = collate(samples, anchors, "cpu")
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    window = []
    for _ in range(2):
        with HostReads() as mode:
            m = dflash_loss(drafter, target.embed, target.lm_head, batch, gamma=2.0)
            opt.zero_grad(set_to_none=True)
            m.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            window.append(window_entry(m, grad_norm))
        # AdamW's step counters are host tensors on a GPU too (torch.optim.adam: not ``capturable``); it reads them
        host = {id(st["step"]) for st in opt.state.values()}
        assert mode.reads and mode.device_reads(host) == []
    record = window_record(window, 1e-3)
    want_tau = sum(float(w[1]) for w in window) / 2
    assert record["expected_tau"] == round(want_tau, 3) and 1 <= want_tau <= 4
    assert len(record["accuracy"]) == 3 and all(0 <= a <= 1 for a in record["accuracy"])
    with HostReads() as mode:  # the mode sees what it should
        float(m.loss.detach()), bool(batch.anchor_valid.any()), batch.ids[batch.ids > 3], batch.ids.to("meta")
    assert mode.device_reads(set()) == ["__float__", "__bool__", "__getitem__", "blocking copy"]
