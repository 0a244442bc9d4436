"""The CPU facts read from /proc/cpuinfo: model name, bf16 units, and the advice printed where bf16 is emulated."""

from trtllm_dflash.hardware import cpu_model, has_bf16_units, slow_bf16_warning

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
AMD = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 avx avx2 fma
"""


def test_model_name_and_bf16_units_come_from_the_flags():
    assert cpu_model(INTEL).startswith("Intel(R) Xeon(R) Platinum 8481C")
    assert cpu_model(AMD) == "AMD EPYC"
    assert has_bf16_units(INTEL) is True
    assert has_bf16_units(AMD) is False
    # a flag name that merely contains the text does not count, and unreadable flags are unknown, not "no"
    assert has_bf16_units("model name : x\nflags : avx512_bf16x\n") is False
    assert has_bf16_units("model name : arm64\n") is None


def test_the_warning_names_the_option_the_cpu_and_the_fix_only_where_bf16_is_emulated():
    msg = slow_bf16_warning("--dtype bfloat16", "--dtype float32", AMD)
    assert "--dtype bfloat16" in msg and "AMD EPYC" in msg and "pass --dtype float32" in msg
    assert slow_bf16_warning("--dtype bfloat16", "--dtype float32", INTEL) is None
    assert slow_bf16_warning("--dtype bfloat16", "--dtype float32", "model name : arm64\n") is None


def test_this_machine_reads_without_error():
    assert cpu_model()
    assert has_bf16_units() in (True, False, None)
