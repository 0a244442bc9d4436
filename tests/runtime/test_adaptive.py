"""``--block-size auto``: the policy (cost model, acceptance model, decision) and the decoder running it."""

import json
import random

import pytest

from conftest import OracleDecoder, greedy_reference
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime import acceptance as acceptance_model
from trtllm_dflash.runtime import cost as cost_model
from trtllm_dflash.runtime import lookup as prompt_lookup
from trtllm_dflash.runtime.acceptance import AcceptanceModel
from trtllm_dflash.runtime.cost import GRID, CostModel
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams

SHIPPED = "trtllm_dflash/data/drafters/smollm2-135m-instruct-dflash"


def cpu_like(ratio16=1.4, draft_frac=0.5):
    """A step cost shaped like this CPU's: flat-ish up to 16 tokens (verify(16) = ratio16 × verify(1)), then
    proportional to tokens (compute bound); a draft pass costs ``draft_frac`` of a verify over as many tokens."""
    verify = [1e-3 * (1 + (ratio16 - 1) * (n - 1) / 15) if n <= 16 else 1e-3 * ratio16 * n / 16 for n in GRID]
    return CostModel(verify, [draft_frac * v for v in verify])


def simulate(policy, rows, outcome, steps):
    """Run ``steps`` decisions; ``outcome(step, row, k)`` -> accepted drafts. Returns the chosen k per step."""
    states = [policy.new_sequence() for _ in range(rows)]
    history = []
    for t in range(steps):
        ks = policy.decide(states)
        for i, (s, k) in enumerate(zip(states, ks)):
            policy.observe(s, k, outcome(t, i, k))
        history.append(ks)
    return history


def test_always_right_drafter_gets_long_blocks():
    policy = AdaptivePolicy(cpu_like(), 16, prior=[0.5] * 15)
    history = simulate(policy, 1, lambda t, i, k: k, 40)
    assert history[0][0] > 0, "this prior alone makes a first draft worth trying"
    assert all(ks == [15] for ks in history[10:]), history
    shy = simulate(AdaptivePolicy(cpu_like(), 16, prior=[0.1] * 15), 1, lambda t, i, k: k, 60)
    assert shy[0] == [0], "a pessimistic prior starts autoregressive"
    assert all(ks == [15] for ks in shy[30:]), "the first re-probe finds the drafter always right"


def test_always_wrong_drafter_settles_on_k0_and_backs_off_probes():
    policy = AdaptivePolicy(cpu_like(), 16, prior=[0.5] * 15)
    history = simulate(policy, 1, lambda t, i, k: 0, 400)
    drafted = [t for t, ks in enumerate(history) if ks[0] > 0]
    assert drafted and history[-1] == [0]
    assert len(drafted) <= 400 // policy.max_probe_every + 5, f"too many probes: {drafted}"
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert gaps[0] < gaps[1] < gaps[2] == max(gaps), f"probe intervals should grow to the cap: {gaps}"


def test_reprobe_picks_up_a_good_stretch():
    policy = AdaptivePolicy(cpu_like(), 16, prior=[0.3] * 15)
    switch = 60  # wrong drafts, then a stretch of boilerplate the drafter gets right
    history = simulate(policy, 1, lambda t, i, k: 0 if t < switch else k, 160)
    assert sum(ks != [0] for ks in history[switch - 30:switch]) <= 1
    probe = next(t for t in range(switch, 160) if history[t][0] > 0)
    assert probe - switch <= policy.max_probe_every
    assert all(ks == [15] for ks in history[probe + 10:]), history[probe:]


def test_probes_stay_within_their_time_budget():
    """Where a probe costs most of a step (this CPU), failed probes cost at most ``probe_budget`` of the decoding
    time after the first (which comes early: until then the acceptance is only the prior's guess); where probing is
    nearly free (a GPU's flat verify), the policy probes every ``probe_every`` steps."""
    cost = cpu_like()
    policy = AdaptivePolicy(cost, 16, prior=[0.1] * 15)
    assert policy.min_probe_interval(1) >= 20 and policy.min_probe_interval(8) > policy.min_probe_interval(1)
    history = simulate(policy, 1, lambda t, i, k: 0, 1000)
    probes = [t for t, ks in enumerate(history) if ks[0] > 0]
    assert probes[0] == policy.probe_every
    extra = sum(cost.step(1, history[t][0], 1) - cost.step(1, 0, 0) for t in probes[1:])
    assert 0 < extra <= policy.probe_budget * 1000 * cost.step(1, 0, 0), probes
    flat = CostModel([1e-3] * len(GRID), [1e-5] * len(GRID))
    assert AdaptivePolicy(flat, 16).min_probe_interval(1) == AdaptivePolicy(flat, 16).probe_every


def test_a_first_probe_needs_the_tokens_to_pay_for_it(tiny_models, cost_root, one_thread):
    """A row that never drafted is probed after ``probe_every`` steps only with at least the budget's probe interval
    of tokens left (``SeqState.remaining``; None: no limit); the decoder sets it from each request's length limit,
    so short requests on a CPU-like cost curve never probe and long ones do."""
    policy = AdaptivePolicy(cpu_like(), 16, prior=[0.1] * 15)
    floor = policy.min_probe_interval(16)
    assert floor > policy.probe_every
    states = [policy.new_sequence() for _ in range(16)]
    for i, s in enumerate(states):
        s.idle_steps = policy.probe_every
        s.remaining = (floor - 1, floor, None)[i % 3]
    ks = policy.decide(states)
    assert [k > 0 for k in ks] == [i % 3 > 0 for i in range(16)], ks

    target, drafter = tiny_models["llama"]
    prompts = prompts_for(3, lengths=(5, 9))
    fixed = cpu_like()
    fixed.alpha = 0.0  # the tiny model's timings do not move the interval under test
    need = AdaptivePolicy(fixed, 4).min_probe_interval(1)
    for extra, probed in ((-1, False), (2, True)):
        for p in prompts:  # one request at a time: the interval of one row
            policy = AdaptivePolicy(fixed, 4, prior=[0.02] * 3)
            n = policy.probe_every + need + extra
            out = SpeculativeDecoder(target, drafter, "auto", max_block_size=4, policy=policy).generate(
                [Request(tuple(p), n)])[0]
            assert (max(out.draft_lengths) > 0) == probed, (n, out.draft_lengths)
            assert list(out.token_ids) == list(greedy_reference(target, [p], n)[0])


def test_batch_drafts_shorter_where_verify_is_compute_bound():
    """Same acceptance (p = 0.7 per position), same per-token costs: 8 rows fill the flat part of the cost curve,
    so the batch verifies fewer drafts than one sequence would."""
    rng = random.Random(0)

    def outcome(t, i, k):
        return next((j for j in range(k) if rng.random() > 0.7), k)

    alone = simulate(AdaptivePolicy(cpu_like(), 16, prior=[0.7] * 15), 1, outcome, 60)
    batch = simulate(AdaptivePolicy(cpu_like(), 16, prior=[0.7] * 15), 8, outcome, 60)
    k_alone = sum(max(ks) for ks in alone[20:]) / 40
    k_batch = sum(max(ks) for ks in batch[20:]) / 40
    assert k_alone >= 3 and k_batch < k_alone, (k_alone, k_batch)


def test_rows_that_do_not_pay_stay_out_of_a_batch_draft():
    policy = AdaptivePolicy(cpu_like(), 16, prior=[0.5] * 15)
    history = simulate(policy, 4, lambda t, i, k: k if i < 2 else 0, 60)
    late = history[30:]
    assert all(ks[0] == ks[1] > 0 for ks in late)
    assert sum(ks[2] + ks[3] > 0 for ks in late) <= 6  # only the occasional re-probe


def test_the_workload_can_lower_the_training_prior_but_not_raise_it():
    """Every row's drafter outcomes pool into ``AdaptivePolicy.workload``; a row's prior is the training log's
    accuracy, lowered to the pooled estimate where that is less: after a batch's rows all fail their first drafts, a
    new sequence expects far less than the log says and does not draft; rows that accept everything leave the others'
    prior where the log put it."""
    policy = AdaptivePolicy(cpu_like(), 16, prior=[0.6] * 15)
    fresh = policy.drafter_expectation(policy.new_sequence())
    history = simulate(policy, 4, lambda t, i, k: 0, 3)
    assert all(k > 0 for k in history[0]), "the prior alone makes every row draft at first"
    assert history[1:] == [[0] * 4] * 2
    assert policy.drafter_expectation(policy.new_sequence())[1] < 0.5 * fresh[1]
    assert policy.decide([policy.new_sequence()]) == [0]
    rich = AdaptivePolicy(cpu_like(), 16, prior=[0.3] * 15)
    simulate(rich, 2, lambda t, i, k: k, 20)
    assert rich.workload.probabilities()[0] > 0.9
    new = rich.new_sequence()
    assert rich.drafter_expectation(new) == new.acceptance.expected_accepted_all()


def test_acceptance_model_conditional_estimates_and_decay():
    m = AcceptanceModel(4, prior=[0.5] * 4, strength=1.0, decay=1.0)
    for _ in range(9):
        m.observe(4, 1)  # draft 1 always accepted, draft 2 always rejected
    assert m.p(0) > 0.9 and m.p(1) < 0.1 and m.p(2) == pytest.approx(0.5)
    assert m.expected_accepted(1) == pytest.approx(m.p(0))
    assert m.expected_accepted(4) == pytest.approx(m.p(0) * (1 + m.p(1) * (1 + m.p(2) * (1 + m.p(3)))))
    fast = AcceptanceModel(4, prior=[0.5] * 4, strength=1.0, decay=0.5)
    for a in [4] * 20 + [0] * 3:
        fast.observe(4, a)
    assert fast.p(0) < 0.3, "three recent failures should outweigh twenty old successes under decay 0.5"


def test_cost_model_follows_observed_step_times():
    cost = cpu_like()
    before = cost.verify(16)
    for _ in range(60):
        cost.observe(16, 3 * before)
    assert cost.verify(16) == pytest.approx(3 * before, rel=0.05)
    assert cost.verify(1) == pytest.approx(1e-3), "a grid point the observations do not touch stays"
    cost.observe(12, 1.0, overhead_s=0.01)
    assert 0 < cost.overhead_s < 0.01


def test_one_outlier_step_moves_the_cost_model_a_bounded_amount():
    """A step that queued (a served verify behind other requests' prefills: seconds instead of milliseconds) moves the
    estimate by at most alpha of MAX_STEP_RATIO, so it cannot make every width look as dear as the widest."""
    cost = cpu_like()
    before = [cost.verify(n) for n in (16, 64)]
    cost.observe(16, 1000 * before[0])
    assert cost.verify(16) == pytest.approx(before[0] * (1 + cost.alpha * (cost_model.MAX_STEP_RATIO - 1)))
    assert cost.verify(64) > 1.5 * cost.verify(16) and cost.verify(64) >= before[1]
    cost.observe(16, before[0] / 1000)
    assert cost.verify(16) > before[0] / cost_model.MAX_STEP_RATIO


def test_a_cost_per_call_observed_at_one_width_keeps_what_wider_verifies_add():
    """Served steps pay a cost per call (the BLS round trip, the step barrier): 16 sequences observed only at 16
    tokens, each step three times the calibrated time, must leave a 64-token verify dearer by what the calibration
    says the 48 further tokens cost (moved locally and kept monotone, the 32- and 64-token points rose to the 16-token
    one's and K = 3 for the whole batch looked free), and the points below untouched."""
    cost, calibrated = cpu_like(), cpu_like()
    for _ in range(80):
        cost.observe(16, 3 * calibrated.verify(16), rows=16)
    assert cost.verify(16) == pytest.approx(3 * calibrated.verify(16), rel=0.02)
    for n in (32, 64, 256):
        assert cost.verify(n) - cost.verify(16) == pytest.approx(calibrated.verify(n) - calibrated.verify(16),
                                                                 rel=0.02), n
    assert [cost.verify(n) for n in (1, 4, 8)] == [calibrated.verify(n) for n in (1, 4, 8)]
    for _ in range(80):  # a faster machine than calibrated: the wider points come down with it, still increasing
        cost.observe(16, calibrated.verify(16) / 2, rows=16)
    assert cost.verify(16) == pytest.approx(calibrated.verify(16) / 2, rel=0.02)
    assert all(b >= a for a, b in zip(cost.verify_s, cost.verify_s[1:]))
    assert cost.verify(64) - cost.verify(16) == pytest.approx(calibrated.verify(64) - calibrated.verify(16), rel=0.05)


def test_verifies_are_priced_by_the_context_they_attend_over():
    """The context-free curve plus α per row and β per verified token for each cached token; an observed step teaches
    the curve only its time beyond the context's share, so one long-context K = 0 step does not make K = 1 (the
    curve's next point, raised to it) look free."""
    alpha, beta = 2e-6, 0.5e-6
    aware, blind = cpu_like(), cpu_like()
    aware.context_row_s, aware.context_token_s = alpha, beta
    rows, context = 16, 16 * 2000
    assert aware.verify(32, rows, context) == pytest.approx(blind.verify(32) + context * (alpha + beta * 2))
    assert aware.step(rows, 1, 0, context=context) - aware.step(rows, 0, 0, context=context) == pytest.approx(
        blind.verify(32) - blind.verify(16) + context * beta)
    seconds = aware.verify(16, rows, context)  # the machine as ``aware`` describes it: the context's share dominates
    for cost in (aware, blind):  # observed at K = 0 for a while
        for _ in range(40):
            cost.observe(16, seconds, rows=rows, context=context)
    assert aware.verify(16) == pytest.approx(cpu_like().verify(16), rel=1e-6)
    assert blind.verify(32) == pytest.approx(blind.verify(16), rel=0.02), "the curve's flat segment: K = 1 looks free"
    assert aware.step(rows, 1, 0, context=context) / aware.step(rows, 0, 0, context=context) > 1.1
    doc = CostModel.from_json(json.loads(json.dumps(aware.to_json())))
    assert (doc.context_row_s, doc.context_token_s) == (alpha, beta)


def test_the_context_calibration_recovers_its_coefficients():
    calls = []

    def measure(rows, width, context):  # 1 ms + 2 µs per token, and the context's share
        calls.append((rows, width, context))
        return 1e-3 + 2e-6 * rows * width + context * (3e-6 * rows + 0.7e-6 * rows * width)

    alpha, beta = cost_model.calibrate_context(measure, context=512, rows=16, repeats=2)
    assert alpha == pytest.approx(3e-6) and beta == pytest.approx(0.7e-6)
    assert {c[2] for c in calls} == {0, 512} and {c[:2] for c in calls} == {(16, 1), (16, 4)}
    # a share of the step that does not grow with its rows stays out of β (and adds to α only its per-row part)
    alpha, beta = cost_model.calibrate_context(lambda r, w, c: measure(r, w, c) + 2e-3 * c / 300, repeats=1)
    assert beta == pytest.approx(0.7e-6) and alpha == pytest.approx(3e-6 + 2e-3 / 300 / 16)
    assert cost_model.calibrate_context(lambda r, w, c: 1e-3, repeats=1) == (0.0, 0.0), "never negative"


def test_cost_cache_round_trip_and_key(tmp_path):
    calls = []

    def measure(n):
        calls.append(n)
        return 1e-3 * (1 + n / 16)

    key = cost_model.cost_key("cpu-x", "float32", 2, "m1")
    first = cost_model.load_or_calibrate(key, measure, measure, 32, root=tmp_path)
    measured = len(calls)
    assert measured > 0 and max(calls) == 32 and len(first.verify_s) == len(GRID)
    assert first.verify(256) > first.verify(32), "beyond the calibrated range the cost keeps growing"
    again = cost_model.load_or_calibrate(key, measure, measure, 32, root=tmp_path)
    assert len(calls) == measured and again.verify_s == first.verify_s
    other = cost_model.load_or_calibrate(cost_model.cost_key("cpu-x", "float32", 1, "m1"), measure, measure, 32,
                                       root=tmp_path)
    assert len(calls) > measured and other.key["threads"] == 1
    path = cost_model.cache_path(key, tmp_path)
    doc = json.loads(path.read_text())
    assert doc["key"] == key and doc["grid"] == list(GRID)
    path.write_text("{not json")
    cost_model.load_or_calibrate(key, measure, measure, 32, root=tmp_path)  # a broken cache is recalibrated
    assert json.loads(path.read_text())["key"] == key


def test_a_stale_cost_cache_is_rescaled_by_a_spot_check(tmp_path):
    key = cost_model.cost_key("cpu-x", "float32", 2, "m1")
    busy = cost_model.load_or_calibrate(key, lambda n: 7e-3 * (1 + n / 16), lambda n: 2e-3 * n, 32, root=tmp_path)
    calls = []

    def quiet(n):  # the same shape, 7x faster: the cache was calibrated under load
        calls.append(n)
        return 1e-3 * (1 + n / 16)

    fresh = cost_model.load_or_calibrate(key, quiet, lambda n: 2e-3 * n, 32, root=tmp_path, check=2)
    assert calls and max(calls) == 1, "only the smallest verify is measured"
    assert fresh.verify(16) == pytest.approx(busy.verify(16) / 7) and fresh.draft_s == busy.draft_s
    cached = cost_model.load_or_calibrate(key, quiet, quiet, 32, root=tmp_path)
    assert cached.verify_s == busy.verify_s, "the cache itself keeps the calibration"


def test_prior_from_the_shipped_drafters_training_log():
    prior = acceptance_model.prior_from_training_log(SHIPPED, 15)
    log = json.loads((__import__("pathlib").Path(SHIPPED) / "training_log.json").read_text())
    assert prior == log["held_out"][-1]["accuracy"][:15]
    assert acceptance_model.prior_from_training_log(SHIPPED, 3) == prior[:3]
    assert acceptance_model.prior_from_training_log("/nonexistent", 15) is None


# ---------------------------------------------------------------------------------------------------------------------
# The decoder under "auto" (tiny random models, float64)


@pytest.fixture
def cost_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    return tmp_path


def prompts_for(seed, lengths=(5, 11, 2, 17)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def test_auto_with_an_always_right_oracle_picks_long_blocks(tiny_models, cost_root, one_thread):
    target, drafter = tiny_models["llama"]
    prompts = prompts_for(1, lengths=(6, 9))
    # 128 tokens: a never-drafted row's first probe waits until it has min_probe_interval tokens left, 41 for these
    # two rows at the calibrated costs and ~95 where the steps run at half the calibrated time (the cost model then
    # lowers every width by the same amount, so a probe's extra width weighs more): with 64 tokens one full-suite run
    # saw no probe at all
    ref = greedy_reference(target, prompts, 128)
    dec = OracleDecoder(target, drafter, "auto", prompts, ref, corrupt=0.0)
    out = dec.generate([Request(tuple(p), 128) for p in prompts])
    assert [r.token_ids for r in out] == ref
    for r in out:  # at worst the prior waits for the first re-probe; once it has seen the drafter, long blocks
        ks = list(r.draft_lengths)
        first = next(i for i, k in enumerate(ks) if k > 0)
        # (step times observed on a shared machine feed the cost model, so not every step is B − 1)
        assert first <= 8 and sum(k >= 8 for k in ks[first + 1:]) >= len(ks[first + 1:]) // 2, ks
    ks = [k for r in out for k in r.draft_lengths]
    cached = list(cost_root.glob("adaptive/cost-*.json"))
    assert cached, "the calibration is cached on disk"
    doc = json.loads(cached[0].read_text())
    assert doc["context_row_s"] >= 0 and doc["context_token_s"] >= 0, "with what attending over a context costs"
    assert dec.policy.context >= sum(len(p) for p in prompts), "the rows' contexts priced the last step"
    tel = dec.policy.telemetry.to_json()
    assert sum(tel["k_distribution"].values()) == len(ks) and tel["num_accepted_tokens"] > 0


def test_auto_with_an_always_wrong_oracle_settles_on_k0(tiny_models, cost_root, one_thread):
    target, drafter = tiny_models["qwen3"]
    prompts = prompts_for(2, lengths=(7,))
    ref = greedy_reference(target, prompts, 80)
    dec = OracleDecoder(target, drafter, "auto", prompts, ref, corrupt=1.0)
    out = dec.generate([Request(tuple(p), 80) for p in prompts])
    assert [r.token_ids for r in out] == ref
    ks = out[0].draft_lengths
    assert len(ks) == 79 and sum(k > 0 for k in ks[20:]) <= 6, ks


def test_auto_is_lossless_on_a_ragged_batch(tiny_models, cost_root, one_thread):
    """A mix of rows that draft and rows that do not (padded in the same verify), different lengths and stops."""
    target, drafter = tiny_models["llama"]
    prompts = prompts_for(7, lengths=(3, 30, 9, 1))
    ref = greedy_reference(target, prompts, 30)
    corrupt = OracleDecoder(target, drafter, "auto", prompts, ref, corrupt=0.0)
    corrupt.corrupt_rows = {1, 3}
    reqs = [Request(tuple(p), n) for p, n in zip(prompts, (30, 9, 30, 17))]
    out = corrupt.generate(reqs)
    assert [r.token_ids for r in out] == [tuple(r[:n]) for r, n in zip(ref, (30, 9, 30, 17))]
    plain = SpeculativeDecoder(target, drafter, "auto").generate(reqs)
    assert [r.token_ids for r in plain] == [r.token_ids for r in out]


def test_sampled_auto_equals_block_size_1(tiny_models, cost_root, one_thread):
    """Per-position sampling noise: the same seed gives the same tokens whatever the block sizes of the steps."""
    target, drafter = tiny_models["qwen3"]
    prompts = prompts_for(4, lengths=(4, 12))
    reqs = [Request(tuple(p), 30, SamplingParams(temperature=0.9, top_p=0.95, seed=s)) for s, p in enumerate(prompts)]
    ar = SpeculativeDecoder(target, None, 1).generate(reqs)
    greedy = greedy_reference(target, prompts, 30)
    # the policy is told what the oracle is worth (80 % of drafts right): with the flat default prior (0.3) whether it
    # drafts at all within 30 tokens depends on the step times this machine measures, and the test would be vacuous
    prior = [0.8] * (drafter.spec.block_size - 1)
    auto = OracleDecoder(target, drafter, "auto", prompts, [r.token_ids for r in ar], corrupt=0.2,
                         prior=prior).generate(reqs)
    fixed = SpeculativeDecoder(target, drafter, 8).generate(reqs)
    assert [r.token_ids for r in auto] == [r.token_ids for r in ar] == [r.token_ids for r in fixed]
    assert [r.token_ids for r in ar] != greedy
    assert max(t for r in auto for t in r.acceptance_lengths) > 1


def test_auto_needs_a_drafter_and_a_sane_max_block(tiny_models, cost_root):
    target, drafter = tiny_models["llama"]
    with pytest.raises(ConfigError, match="block_size='auto': auto needs a drafter"):
        SpeculativeDecoder(target, None, "auto")
    with pytest.raises(ConfigError, match="max_block_size=17: must be <= the drafter's trained block_size"):
        SpeculativeDecoder(target, drafter, "auto", max_block_size=17)
    with pytest.raises(ConfigError, match="block_size='8'"):
        SpeculativeDecoder(target, drafter, "8")
    policy = AdaptivePolicy(cpu_like(), 4)
    dec = SpeculativeDecoder(target, drafter, "auto", max_block_size=4, policy=policy)
    out = dec.generate([Request((5, 6, 7), 12)])[0]
    assert dec.block_size_label == "auto" and max(out.draft_lengths) <= 3


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_auto_equals_block_size_1_on_the_real_model(smollm2, temperature):
    """SmolLM2 + the shipped drafter, greedy and sampled: ``auto`` (with the shipped drafter, and with an oracle
    that makes it verify every k) emits exactly what ``--block-size 1`` emits."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    prompts = [encode_prompt(tok, q, chat=True) for q in ("Write a Python function that reverses a string.",
                                                           "Name three colours.")]
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    reqs = [Request(tuple(p), 32, SamplingParams(temperature=temperature, seed=i), stop_token_ids=stops)
            for i, p in enumerate(prompts)]
    ar = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(reqs)]
    prior = acceptance_model.prior_from_training_log(smollm2["drafter"], 15)
    shipped = SpeculativeDecoder(target, drafter, "auto", policy=AdaptivePolicy(cpu_like(), 16, prior))
    assert [r.token_ids for r in shipped.generate(reqs)] == ar
    oracle = OracleDecoder(target, drafter, "auto", prompts, ar, corrupt=0.3,
                           policy=AdaptivePolicy(cpu_like(), 16, [0.6] * 15))
    out = oracle.generate(reqs)
    assert [r.token_ids for r in out] == ar
    assert len({k for r in out for k in r.draft_lengths}) >= 3, "the oracle should make auto verify several k"


@pytest.mark.slow
def test_triton_auto_equals_the_baseline_and_reports_metrics(smollm2, tmp_path_factory):
    """A real Triton server on a repository rendered with --block-size auto: the dflash ensemble (auto) streams
    what the baseline ensemble streams, greedy and sampled, and the metrics endpoint carries the chosen-k counts,
    the time split and the ecosystem's speculative-decoding counter names."""
    pytest.importorskip("tritonclient.grpc")
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.perf.metrics import fetch_metrics, parse_prometheus
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size="auto", max_seq_len=512,
                                max_sequences=4, idle_timeout_s=60, trtllm_names=False),
                     tmp_path_factory.mktemp("repo") / "repo")
    with TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log") as server, \
            DFlashClient(server.grpc_url) as client:
        for params in (GenerateParams("Write a Python function that adds two numbers.", 24),
                       GenerateParams("Name a colour.", 16, temperature=0.8, seed=3)):
            auto = client.generate("dflash", params)
            assert auto.token_ids == client.generate("baseline", params).token_ids
        samples = parse_prometheus(fetch_metrics(server.metrics_url))

    def total(name, **labels):
        return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))

    steps = total("dflash_steps_total", model="dflash")
    assert steps > 0 and total("dflash_chosen_draft_length_total", model="dflash") == steps
    assert total("dflash_step_seconds_total", model="dflash", part="verify") > 0
    drafted = total("dflash_draft_tokens_total", model="dflash")
    assert drafted > 0, "the first probe (step 8) drafts with the lazily joined taps of the k = 0 steps before it"
    assert total("trtllm_spec_decode_num_draft_tokens_total", model_name="dflash") == drafted
    assert total("vllm:spec_decode_num_draft_tokens_total", model_name="dflash") == drafted
    accepted = total("vllm:spec_decode_num_accepted_tokens_total", model_name="dflash")
    assert total("vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="dflash") == accepted
    tau = total("trtllm_spec_decode_acceptance_length", model_name="dflash")
    assert tau == pytest.approx((accepted + steps) / steps, rel=1e-3)
    assert 0 <= total("trtllm_spec_decode_draft_overhead", model_name="dflash") < 1


def test_ngram_continuation_is_prompt_lookup():
    assert prompt_lookup.ngram_continuation([1, 2, 3, 9, 9, 1, 2, 3], 4) == [9, 9, 1, 2]
    assert prompt_lookup.ngram_continuation([5, 1, 2, 7, 1, 2], 1) == [7]  # the latest earlier match of the longest tail
    assert prompt_lookup.ngram_continuation([4, 1, 8, 6, 1], 3) == [8, 6, 1]  # falls back to a 1-gram
    assert prompt_lookup.ngram_continuation([1, 2, 3], 5) == []
    # several proposals, longest tail first: (1 2) recurs once ([9, 9] after it), then (2) twice, but what followed
    # its earlier occurrence ([9, 9]) is proposed already
    assert prompt_lookup.ngram_candidates([1, 2, 9, 9, 2, 9, 1, 2], 2, 8, max_n=2, per_n=2) == [[9, 9], [9, 1]]
    assert prompt_lookup.ngram_candidates([1, 2, 9, 9, 2, 9, 1, 2], 2, 1, max_n=2, per_n=2) == [[9, 9]]


def test_ngram_lookup_reports_what_predicts_acceptance():
    """The same proposal as ``ngram_continuation``, with how far back the matched occurrence agrees with the
    context's end and whether the n-gram's two latest occurrences were followed by different tokens."""
    lk = prompt_lookup.ngram_lookup([1, 2, 3, 9, 9, 1, 2, 3], 4)
    assert lk == prompt_lookup.Lookup([9, 9, 1, 2], match=3, split=False)
    # (1 2 3) occurred twice before, followed by 9 (latest) and by 5: split; the latest match goes back 5 tokens
    lk = prompt_lookup.ngram_lookup([1, 2, 3, 5, 4, 0, 1, 2, 3, 9, 7, 4, 0, 1, 2, 3], 3)
    assert lk == prompt_lookup.Lookup([9, 7, 4], match=5, split=True)
    assert prompt_lookup.ngram_lookup([1, 2, 3], 5) == prompt_lookup.Lookup([])
    rng = random.Random(0)
    for _ in range(500):
        ctx = [rng.randint(0, 3) for _ in range(rng.randint(1, 30))]
        for min_n in (1, 2):
            assert prompt_lookup.ngram_lookup(ctx, 5, 3, min_n).tokens == prompt_lookup.ngram_continuation(ctx, 5, 3, min_n)
            assert prompt_lookup.ngram_lookup(ctx, 5, 3, min_n).match <= prompt_lookup.MAX_MATCH
    # a long match is likelier to be accepted than a short one, a split n-gram less than an unsplit one
    long, short, split = (prompt_lookup.Lookup([1], m, sp).prior(15) for m, sp in ((24, False), (2, False), (2, True)))
    assert len(long) == 15 and long[0] > short[0] > split[0] and long[1] > short[1]


def test_policy_follows_the_lookups_features():
    """A 6-token lookup after a long unsplit match is verified, one after a short split match is not (the same
    fresh sequence history); without features the two look alike."""
    policy = AdaptivePolicy(cpu_like(ratio16=4.0), 16, prior=[0.05] * 15, ngram=True)  # verify(7) = 2.2 × verify(1)
    good, poor = policy.new_sequence(), policy.new_sequence()
    good.lookup, poor.lookup = prompt_lookup.Lookup([5] * 6, 24), prompt_lookup.Lookup([5] * 6, 2, split=True)
    assert policy.decide([good], [6]) == [6] and good.source == "ngram"
    assert policy.decide([poor], [6]) == [0] and poor.source is None
    good.lookup = poor.lookup = None
    assert policy.lookup_expectation(good) == policy.lookup_expectation(poor)


def test_a_static_batch_values_the_rows_that_set_its_length():
    """In-process, a batch takes as many steps as its furthest-behind row: a row ahead of it gets what one row's
    leaving saves a plain step (``row_share``), and its good lookup no longer pays for widening the critical row's
    verify too."""
    policy = AdaptivePolicy(cpu_like(ratio16=4.0), 16, prior=[0.05] * 15, ngram=True)
    share = policy.row_share(4, 4 * 300)
    assert 0 < share < 0.5 and policy.batch_weights([40, 39, 30, 38], 4 * 300) == [1.0, 1.0, share, 1.0]
    assert policy.batch_weights([]) == [] and policy.row_share(1) == 1.0
    flat = AdaptivePolicy(CostModel([1e-3] * len(GRID), [1e-3] * len(GRID)), 16)  # a GPU: a row costs nothing
    assert flat.row_share(16) == 0.0
    policy.cost.context_row_s = 1e-4  # the rows' contexts dominate the step: a row's leaving saves its share
    assert policy.row_share(4, 4 * 300) == pytest.approx(0.25, abs=0.05)

    def plan(weight_ahead):
        policy = AdaptivePolicy(cpu_like(ratio16=4.0), 16, prior=[0.05] * 15, ngram=True)
        behind, ahead = policy.new_sequence(), policy.new_sequence()
        ahead.lookup, ahead.weight = prompt_lookup.Lookup([5] * 6, 24), weight_ahead
        return policy.decide([behind, ahead], [0, 6])

    assert plan(1.0) == [0, 6]  # serving: every token counts
    assert plan(share) == [0, 0]


def test_policy_verifies_a_good_ngram_without_a_draft_pass():
    """Prompt lookup that is always right, drafter always wrong: steps verify the n-gram (no draft pass); with the
    n-gram always wrong too, the policy goes back to k = 0."""
    policy = AdaptivePolicy(cpu_like(ratio16=2.0), 16, prior=[0.1] * 15, ngram=True)
    state = policy.new_sequence()
    sources = []
    for t in range(100):
        ks = policy.decide([state], [6])
        right = t < 30
        sources.append((state.source, ks[0]))
        policy.observe(state, ks[0], ks[0] if right and state.source == "ngram" else 0)
    assert sum(src == "ngram" and k == 6 for src, k in sources[2:30]) >= 24, sources[:30]  # + drafter re-probes
    assert all(k > 0 for _, k in sources[:30])
    late = sources[80:]  # mostly k = 0; left: the drafter's re-probes and a rare one-token n-gram retry
    assert sum(src is not None for src, _ in late) <= 7 and sum(k for _, k in late) <= 12, sources[30:]
    assert policy.telemetry.ngram_steps >= 28


def test_auto_with_ngram_is_lossless(tiny_models, cost_root, one_thread):
    target, drafter = tiny_models["llama"]
    prompts = [[7, 8, 9, 10] * 6, [3, 4, 5, 3, 4, 5, 3, 4]]
    ref = greedy_reference(target, prompts, 40)
    dec = SpeculativeDecoder(target, drafter, "auto", ngram=True)
    out = dec.generate([Request(tuple(p), 40) for p in prompts])
    assert [r.token_ids for r in out] == ref


def test_fixed_block_with_ngram_is_lossless_and_skips_draft_passes(tiny_models, one_thread):
    """At a fixed block size, rows whose context ends in a recurring 2-gram verify prompt lookup's continuation (no
    draft pass for them), the others draft; greedy and seeded sampling give the same tokens as without it."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    target, drafter = tiny_models["llama"]
    prompts = [[7, 8, 9, 10] * 6, [3, 4, 5, 3, 4, 5, 3, 4], [11, 12, 13]]
    ref = greedy_reference(target, prompts, 40)
    calls = []

    def counting(propose, bonus, dcache, rows, committed, num_drafts=None):
        calls.append(len(bonus))
        return propose(bonus, dcache, rows, committed, num_drafts)

    dec = SpeculativeDecoder(target, drafter, 8, ngram=True, proposer=counting)
    out = dec.generate([Request(tuple(p), 40) for p in prompts])
    assert [r.token_ids for r in out] == ref
    assert all(max(r.acceptance_lengths) <= 8 for r in out)
    row_steps = sum(len(r.acceptance_lengths) for r in out)
    assert sum(r.lookup_steps for r in out) > 0 and sum(calls) == row_steps - sum(r.lookup_steps for r in out)
    sampled = [Request(tuple(p), 24, sampling=SamplingParams(0.8, 0, 1.0, 5)) for p in prompts]
    plain = SpeculativeDecoder(target, drafter, 8).generate(sampled)
    assert [r.token_ids for r in dec.generate(sampled)] == [r.token_ids for r in plain]


def test_a_verify_computes_only_each_rows_real_tokens(tiny_models):
    """Rows padded with −1 to a step's common width: the layers' projections and MLPs see only the real tokens, and
    each row's outcome (emitted tokens, taps) is the one it gets verified alone without padding."""
    import torch

    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.steps import TargetVerifier

    target, drafter = tiny_models["qwen3"]
    taps = drafter.spec.target_layer_ids
    prompts = [[9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6], [3, 4, 5]]
    together, alone = (TargetVerifier(target, taps, 3, 64, 16) for _ in range(2))
    firsts = []
    for v in (together, alone):
        firsts = [v.start(i, p, SamplingParams(), True).first_token for i, p in enumerate(prompts)]
    blocks = [[firsts[0], 9, 8, 7, 9], [firsts[1], -1, -1, -1, -1], [firsts[2], 6, -1, -1, -1]]
    seen = []
    hook = target.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[:-1].numel()))
    try:
        got = together.verify([0, 1, 2], blocks, True)
        assert seen == [5 + 1 + 2]
        want = [alone.verify([i], [[t for t in b if t >= 0]], True)[0] for i, b in enumerate(blocks)]
    finally:
        hook.remove()
    for g, w in zip(got, want):
        assert g.emitted == w.emitted
        torch.testing.assert_close(g.taps, w.taps)
    # off the CPU (a GPU's padded slots cost nothing; packing would add kernel launches) the block is run whole
    assert target.verify_widths([5, 1, 2]).tolist() == [5, 1, 2]
    assert type(target)(target.spec, device="meta").verify_widths([5, 1, 2]) is None


def test_decide_finds_the_best_plan_over_every_set_of_drafting_rows():
    """Brute force over every k and every set of drafting rows (not only the prefixes of the rows sorted by gain
    that ``decide`` walks), random acceptance histories, lookups and weights: decide's plan has the best rate."""
    rng = random.Random(7)
    for trial in range(60):
        b = rng.randint(1, 5)
        policy = AdaptivePolicy(cpu_like(ratio16=rng.uniform(1.2, 4.0), draft_frac=rng.uniform(0.2, 1.0)), 8,
                                prior=[rng.uniform(0.05, 0.9)] * 7, ngram=True)
        states, lens = [policy.new_sequence() for _ in range(b)], []
        for s in states:
            s.drafted, s.weight, s.context = 1, rng.choice([1.0, 0.3]), rng.randint(0, 400)
            for _ in range(rng.randint(0, 6)):
                k = rng.randint(1, 7)
                s.acceptance.observe(k, rng.randint(0, k))
            n = rng.choice([0, 0, 2, 7])
            s.lookup = prompt_lookup.Lookup([9] * n, rng.randint(2, 30), rng.random() < 0.3) if n else None
            lens.append(n)
        ks = policy.decide(states, lens)
        prior = policy.drafter_prior()
        best = sum(s.weight for s in states) / policy.cost.step(b, 0, 0, context=policy.context)
        for k in range(1, 8):
            exp = [policy.drafter_expectation(s, prior)[k] for s in states]
            free = [policy.lookup_expectation(s)[min(k, n)] if n else 0.0 for s, n in zip(states, lens)]
            for mask in range(1 << b):
                rows = [i for i in range(b) if mask >> i & 1]
                if not rows and not any(free):
                    continue
                tokens = sum(s.weight * (1 + (exp[i] if i in rows else free[i])) for i, s in enumerate(states))
                best = max(best, tokens / policy.cost.step(b, k, len(rows), bool(rows), policy.context))
        assert policy.last_rate == pytest.approx(best, rel=1e-12), (trial, ks)
        assert all(k == 0 or s.source in ("drafter", "ngram") for k, s in zip(ks, states))


def test_expectations_are_kept_until_the_counts_or_the_prior_change():
    """``expected_accepted_all`` answers a repeated question from memory (decide asks it of every row every step),
    and an outcome, a decay or another prior gets a fresh answer."""
    model = AcceptanceModel(4, [0.5] * 4)
    first = model.expected_accepted_all((0.5,) * 4)
    assert model.expected_accepted_all((0.5,) * 4) is first
    assert model.expected_accepted_all((0.2,) * 4) != first
    for change in (lambda m: m.observe(3, 3), lambda m: m.relax()):
        model, twin = AcceptanceModel(4, [0.5] * 4), AcceptanceModel(4, [0.5] * 4)
        model.observe(2, 1)
        twin.observe(2, 1)
        before = model.expected_accepted_all((0.5,) * 4)  # remembered ...
        change(model)
        change(twin)
        after = model.expected_accepted_all((0.5,) * 4)  # ... and forgotten
        assert after != before and after == twin.expected_accepted_all((0.5,) * 4)
    fresh = AcceptanceModel(4, [0.5] * 4)
    assert fresh.expected_accepted_all() == fresh.expected_accepted_all((0.5,) * 4)
