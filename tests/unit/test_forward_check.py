"""How a kernel self-test reads (hidden_states.forward_check.KernelCheck); the tests themselves run
against real kernels in tests/contract/test_forward_check.py."""
import math

from hidden_states.forward_check import TOLERANCE, KernelCheck


def test_an_error_over_the_tolerance_is_wrong_and_says_where():
    check = KernelCheck("RMSNorm (model.layers.0.self_attn.q_norm)", "[16, 4, 32]/stride [256, 32, 1]/bfloat16", 1.37)
    assert not check.ok
    assert str(check) == ("RMSNorm (model.layers.0.self_attn.q_norm) on [16, 4, 32]/stride [256, 32, 1]/bfloat16: "
                          "relative error 1.37e+00 (WRONG)")
    assert KernelCheck("RMSNorm (norm)", "[16, 128]/stride [128, 1]/bfloat16", TOLERANCE / 10).ok


def test_a_module_that_could_not_be_replayed_is_reported_not_failed():
    check = KernelCheck("MRotaryEmbedding (rotary_emb)", "[3, 16]/stride [16, 1]/int64", math.nan,
                        untested="TypeError: unexpected positions")
    assert check.ok
    assert "not self-tested (TypeError: unexpected positions)" in str(check)
