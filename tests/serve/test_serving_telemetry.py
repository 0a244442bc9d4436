"""The loop models' custom metrics (serve/triton/telemetry.py) gather counts in the stub and hand them to Triton in few
calls: every metric call is a round trip to the server process."""

from collections import Counter

from trtllm_dflash.serve.triton import telemetry
from trtllm_dflash.runtime.stepper import Update
from trtllm_dflash.serve.triton.telemetry import LoopTelemetry


class FakePb:
    """pb_utils' metric API: families of metrics, each call counted."""

    def __init__(self) -> None:
        self.values: Counter = Counter()
        self.calls = 0
        pb = self

        class Metric:
            def __init__(self, name, labels):
                self.key = (name, tuple(sorted(labels.items())))

            def increment(self, value):
                pb.calls += 1
                pb.values[self.key] += value

            def set(self, value):
                pb.calls += 1
                pb.values[self.key] = value

        class MetricFamily:
            COUNTER, GAUGE = "counter", "gauge"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels):  # noqa: N802 - pb_utils' name
                return Metric(self.name, labels)

        self.MetricFamily = MetricFamily

    def total(self, name, **labels):
        return sum(v for (n, ls), v in self.values.items() if n == name and set(labels.items()) <= set(ls))


def _update(final=False):
    return Update([1, 2, 3], 0, [2, 1], 3, 1, final, "length" if final else None, [3, 0],
                  {"draft": 0.01, "verify": 0.02, "overhead": 0.0})


def test_counts_reach_triton_in_few_calls_and_all_of_them_by_the_request_end(monkeypatch):
    monkeypatch.setattr(telemetry, "FLUSH_S", 3600.0)  # nothing is due by time in this test
    pb = FakePb()
    t = LoopTelemetry(pb, "dflash", 4)
    t.active(+1)
    calls = pb.calls
    for _ in range(50):  # 50 streamed updates and batched calls of one request: gathered, not yet handed over
        t.record(_update())
        t.step_call("verify", 16)
    assert pb.calls == calls and pb.total("dflash_steps_total") == 0
    t.record(_update(final=True))  # the request's last update flushes everything
    assert pb.total("dflash_steps_total", model="dflash") == 102
    assert pb.total("dflash_acceptance_length_total", tau="2") == 51
    assert pb.total("dflash_chosen_draft_length_total", k="3") == 51
    assert pb.total("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 51
    assert pb.total("dflash_draft_tokens_total") == 153 == pb.total("trtllm_spec_decode_num_draft_tokens_total")
    assert pb.total("dflash_step_rows_total", step="verify") == 800
    assert pb.total("dflash_requests_total") == 1
    assert pb.total("trtllm_spec_decode_acceptance_length") == (51 + 102) / 102
    assert pb.calls - calls < 30, pb.calls - calls  # one call per metric touched, not per update
    t.step_call("start", 1)  # a cancelled request sends no final update: its end flushes
    t.active(-1)
    assert pb.total("dflash_step_requests_total", step="start") == 1 and pb.total("dflash_active_sequences") == 0


def test_counts_are_handed_over_once_flush_s_passed(monkeypatch):
    monkeypatch.setattr(telemetry, "FLUSH_S", 0.0)
    pb = FakePb()
    t = LoopTelemetry(pb, "dflash", 4)
    t.record(_update())
    assert pb.total("dflash_steps_total") == 2
