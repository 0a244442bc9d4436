"""The compiled decode step (``models.compiled``), the flat layer loop and whole-step kernel kinds: the same outputs
as the eager modules, taken only where they apply, and lossless on the real model."""

import pytest
import torch

from conftest import eager_reference
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models import compiled, products
from trtllm_dflash.models.layers import Linear, plain_linears
from trtllm_dflash.models.target import TargetModel, bind_layers
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder


def _filled(target: TargetModel, rows: int, lengths: list[int], seed: int = 0):
    """A cache of ``rows`` rows whose rows hold ``lengths`` committed tokens of a random prompt (eager prefill)."""
    cache = target.new_cache(rows, max(lengths) + 8)
    ids = torch.randint(0, target.spec.vocab_size, (rows, max(lengths)), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode(), compiled.forcing("off"):
        target(ids, cache)
    cache.commit(None, torch.tensor(lengths))
    return cache


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    """The tiny random Llama target in float32, the dtype the kernel choices and the compiled step are for."""
    return TargetModel.from_pretrained(tiny_dirs["llama"][0], dtype=torch.float32)


@pytest.mark.parametrize("s", [1, 5])
def test_the_flat_layer_loop_is_the_modules_bit_for_bit(tiny, s, monkeypatch):
    """The loop over bound parameters runs the modules' operators in their order: the same bits, taps and cache."""
    target = tiny
    outs = []
    for flat in (False, True):
        monkeypatch.setattr(TargetModel, "flat", flat)
        cache = _filled(target, 2, [7, 4])
        with torch.inference_mode(), compiled.forcing("off"):
            hidden, taps = target(torch.arange(2 * s).view(2, s) + 3, cache, tap_layers=(0, 2),
                                  widths=torch.tensor([s, max(s - 2, 1)]))
        outs.append((hidden, taps, cache.k.clone(), cache.v.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_hooks_and_converted_modules_run_every_module(tiny):
    """A hook on any layer module (or a projection another tool converted) turns the flat loop and the compiled step
    off: the hook sees its call."""
    target = tiny
    assert bind_layers(target.model.layers) is not None
    seen = []
    hook = target.model.layers[1].mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    try:
        assert bind_layers(target.model.layers) is None
        cache = _filled(target, 1, [6])
        with torch.inference_mode(), compiled.forcing("on"):
            target(torch.tensor([[5]]), cache)
        assert seen and not any(e.seconds for e in target.__dict__.get("_decode_engines", {}).values())
    finally:
        hook.remove()
    plain_linears(target)  # what a quantizer's conversion sees: nn.Linear, not this package's subclass
    try:
        assert bind_layers(target.model.layers) is None
    finally:
        for module in target.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = Linear
    assert bind_layers(target.model.layers) is not None


def test_the_compiled_step_applies_only_where_it_can(tiny):
    """Not under autograd, not for rows that are not one run of consecutive cache rows, not for a row with fewer than
    two cached tokens: those return None and run eagerly (nothing compiled here)."""
    target = tiny
    cache = _filled(target, 3, [5, 5, 1])
    with compiled.forcing("on"):
        assert target._engine_step(torch.tensor([[1]]), cache, None, (), None) is None  # grad enabled
        with torch.inference_mode():
            assert target._engine_step(torch.tensor([[1], [2]]), cache, torch.tensor([0, 2]), (), None) is None
            assert target._engine_step(torch.tensor([[1], [2]]), cache, torch.tensor([1, 2]), (), None) is None
    with compiled.forcing("off"), torch.inference_mode():
        assert target.decode_engine() is None


def test_an_unknown_compiled_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(compiled.ENV, "fast")
    with pytest.raises(ConfigError) as err:
        compiled.setting()
    assert compiled.ENV in str(err.value) and "fast" in str(err.value) and "unset it" in str(err.value)


def test_a_whole_step_kind_runs_every_product_of_the_step(tiny, monkeypatch, tmp_path):
    """``step_kind`` makes every product in its block run one kind; ``choose_step`` times the forward under each kind
    and the per-product choices and records the fastest, which the target's forwards then take."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    target = tiny
    ran = []
    real_run = products.run
    monkeypatch.setattr(products, "run", lambda kind, *a: ran.append(kind) or real_run(kind, *a))
    cache = _filled(target, 1, [6])
    with torch.inference_mode(), compiled.forcing("off"):
        for kind in products.candidates(torch.float32):
            ran.clear()
            with products.step_kind(kind):
                target(torch.tensor([[5]]), cache)
            assert ran and set(ran) == {kind}
        choice = products.choose_step(target.step_name, target.dtype, 1, lambda: target(torch.tensor([[5]]), cache))
    entry = products.step_entry(target.step_name, torch.float32, 1)
    table = products.table()
    assert table.choices[entry] == choice == min(table.timings[entry], key=table.timings[entry].get)
    assert set(table.timings[entry]) == {products.PER_PRODUCT, *products.candidates(torch.float32)}
    assert products.step_choice(target.step_name, torch.float32, 1) == choice
    if choice != products.PER_PRODUCT:
        ran.clear()
        with torch.inference_mode(), compiled.forcing("off"):
            target(torch.tensor([[5]]), cache)
        assert set(ran) == {choice}


@pytest.fixture(scope="module")
def real_compiled(smollm2):
    """The real pair, loaded for this module: its target's compiled step is compiled here at its first use."""
    return load_pair(smollm2["target"], smollm2["drafter"])


@pytest.mark.slow
@pytest.mark.parametrize("rows, first, lengths, form", [(1, 0, [41], "weight-major"), (2, 0, [41, 29], "weight-major"),
                                                      (2, 1, [7, 41, 33], "weight-major"), (1, 1, [9, 41], "linear"),
                                                      (1, 0, [41], "packed")])
def test_the_compiled_step_matches_the_eager_one_on_the_real_model(real_compiled, rows, first, lengths, form):
    """Hidden states, taps and the K/V written equal the eager forward's within float32 rounding over 30 layers
    (fused loops sum in another order), and every row's greedy token is the same."""
    if form not in compiled.forms():
        pytest.skip(f"the {form} kernel does not run on this machine")
    target, drafter = real_compiled
    taps_at = drafter.spec.target_layer_ids
    ids = torch.tensor([[11 + r] for r in range(rows)])
    sel = torch.arange(first, first + rows)
    outs = []
    for setting in ("off", "on"):
        cache = _filled(target, len(lengths), lengths, seed=1)
        with torch.inference_mode(), compiled.forcing(setting, form):
            hidden, taps = target(ids, cache, sel, tap_layers=taps_at)
            outs.append((hidden, taps, target.logits(hidden).argmax(-1), cache.k, cache.v))
    with compiled.forcing("on", form):
        assert target.decode_engine().steps  # it did run compiled
    (h0, t0, a0, k0, v0), (h1, t1, a1, k1, v1) = outs
    torch.testing.assert_close(h1, h0, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(t1, t0, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(k1, k0, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(v1, v0, atol=2e-3, rtol=1e-3)
    assert torch.equal(a1, a0)


@pytest.mark.slow
def test_decoding_with_the_compiled_step_is_lossless_on_the_real_model(real_compiled, smollm2):
    """Autoregressive decoding (one row and a batch of three) and fixed-block DFlash through the runtime, the
    compiled step on, emit the tokens of eager autoregressive decoding."""
    target, drafter = real_compiled
    prompts, want = eager_reference(target, smollm2["target"])
    with compiled.forcing("on"):
        for block_size, batch in ((1, prompts[:1]), (1, prompts), (16, prompts)):
            dec = SpeculativeDecoder(target, drafter if block_size > 1 else None, block_size)
            engine = target.decode_engine(len(batch))  # the engine this machine's table picks for the batch's rows
            before = engine.steps
            got = dec.generate([Request(tuple(p), 40) for p in batch])
            assert [g.token_ids for g in got] == want[:len(batch)], block_size
            if block_size == 1:  # the decode steps ran compiled
                assert engine.steps - before >= 39


def test_a_choice_measured_inside_another_one_completes(monkeypatch, tmp_path):
    """Timing a whole step measures the products and attention shapes it meets first (their own choices) while the
    step's choice is being made: the table's lock is taken again by the same thread, not waited on."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    table = products.table()
    outer = table.choose("step:outer", lambda: {"a": 2.0, "b": table.choose("inner", lambda: {"x": 1.0}) and 1.0})
    assert outer == "b" and table.choices["inner"] == "x"


def test_a_failing_compiler_leaves_decoding_eager(tiny, monkeypatch, capsys):
    """A compiled step that fails (a toolchain, a locale) is reported once on stderr and the step runs eagerly, with
    the eager step's outputs; the process does not try again."""
    def broken(self, *args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled.CompiledDecode, "__call__", broken)
    tiny.__dict__.pop("_decode_engines", None)
    outs = []
    for setting in ("on", "off"):
        cache = _filled(tiny, 1, [6])
        with torch.inference_mode(), compiled.forcing(setting):
            outs.append(tiny(torch.tensor([[5]]), cache)[0])
    assert torch.equal(outs[0], outs[1])
    with compiled.forcing("on"):
        assert tiny.decode_engine().failed == "RuntimeError: no compiler here"
    assert "the compiled decode step failed (RuntimeError: no compiler here)" in capsys.readouterr().err
    tiny.__dict__.pop("_decode_engines", None)
