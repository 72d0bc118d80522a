"""The certificate's arithmetic: the checkpoint's last step read alone, the bound that rounding explains,
and what it tells from a wrong state (shifted, another row's, FP8 counted as bfloat16)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hidden_states.certify import certificate as C  # noqa: E402
from hidden_states.certify.certifier import Certifier  # noqa: E402
from hidden_states.certify.head import FinalHead, Uncertifiable  # noqa: E402
from hidden_states.certify.witness import Witness  # noqa: E402
from tests.unit.certified_model import engine_logprobs, head_checkpoint, states  # noqa: E402

BF16, FP8 = C.HALF_ULP["bfloat16"], C.HALF_ULP["float8_e4m3fn"]
POSITIONS = torch.tensor([0, 5, 17, 30, 31])


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return FinalHead.load(head_checkpoint(tmp_path_factory.mktemp("model")))


def worst(head, state, engine_state, unit=BF16, floor=0.0):
    ids, logprobs = engine_logprobs(head, engine_state, POSITIONS)
    return C.agreement(head, state[POSITIONS], ids, logprobs, state_unit=unit, engine_unit=BF16, state_floor=floor)


def test_the_head_is_read_from_the_checkpoint_alone(tmp_path):
    path = head_checkpoint(tmp_path / "tied", tied=True)
    head = FinalHead.load(path)
    assert head.weight.shape == (512, 64) and head.norm.shape == (64,) and head.eps == 1e-5
    x = torch.randn(3, 64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * head.norm
    assert torch.allclose(head.logits(x), want @ head.weight.T)


@pytest.mark.parametrize("config, said", [({"model_type": "gemma2"}, "model_type 'gemma2'"),
                                          ({"final_logit_softcapping": 30.0}, "sets final_logit_softcapping")])
def test_a_last_step_it_cannot_compute_is_refused_by_name(tmp_path, config, said):
    with pytest.raises(Uncertifiable, match=said):
        FinalHead.load(head_checkpoint(tmp_path / "m", **config))


def test_a_checkpoint_without_the_head_is_refused_naming_the_tensor(tmp_path):
    path = head_checkpoint(tmp_path / "m")
    (path / "config.json").write_text((path / "config.json").read_text().replace('"tie_word_embeddings": false',
                                                                                '"tie_word_embeddings": true'))
    with pytest.raises(Uncertifiable, match="no model.embed_tokens.weight"):
        FinalHead.load(path)


def test_right_rows_pass_within_the_bound_and_the_bound_is_not_loose(head):
    """200 rows of bfloat16 states, the engine rounding as vLLM's path does: every position within its
    bound, and the largest at a sizeable share of it (a bound 100x too wide would pass wrong rows)."""
    ratios = [worst(head, s, s).worst for s in states(200, 32)]
    assert max(ratios) < 1
    assert max(ratios) > 0.05


def test_a_state_shifted_by_one_token_fails_every_position(head):
    state = states(1, 32)[0]
    found = worst(head, torch.roll(state, 1, dims=0), state)
    assert found.failing == [0, 1, 2, 3, 4]
    assert found.worst > 10


def test_another_rows_state_fails(head):
    mine, other = states(2, 32)
    assert worst(head, other, mine).failing == [0, 1, 2, 3, 4]


def test_fp8_states_pass_with_fp8s_rounding_counted_and_not_without(head):
    """The written state is FP8 x its per-token scale: within the bound with FP8's unit; counted as
    bfloat16, FP8's rounding is past it: the unit is what the bound rests on."""
    from hidden_states import fp8_states

    ratios_fp8, ratios_bf16 = [], []
    for state in states(50, 32):
        quantized, scales = fp8_states.quantize([state])
        written = fp8_states.dequantize(quantized[0], scales.view(-1, 1))
        floor = scales.view(-1)[POSITIONS] * 2.0 ** -10
        ratios_fp8.append(worst(head, written, state, unit=FP8, floor=floor).worst)
        ratios_bf16.append(worst(head, written, state).worst)
    assert max(ratios_fp8) < 1
    assert max(ratios_bf16) > 1


def test_the_sketch_names_a_layer_taken_from_another_row():
    a, b = [states(3, 32, seed=s) for s in (7, 8)]
    at = [layer[POSITIONS] for layer in a]
    certificate = C.Certificate(POSITIONS, torch.zeros(5, 1, dtype=torch.long), torch.zeros(5, 1),
                                torch.zeros(5), C.sketch(at), torch.ones(5))
    assert C.sketch_mismatch(at, certificate) == []
    assert C.sketch_mismatch([at[0], b[1][POSITIONS], at[2]], certificate) == [1]


def test_a_certificate_travels_as_tensors_and_back(head):
    layers = states(2, 32)
    ids, logprobs = engine_logprobs(head, layers[1], POSITIONS)
    # the run's certifier makes it (it raises CertificateFailed where a position fails)
    certificate = Certifier(head, 1).certify("a row", layers, Witness(POSITIONS.tolist(), ids.tolist(), logprobs.tolist()))
    tensors = certificate.tensors()
    assert sorted(tensors) == sorted(C.PREFIX + name for name in C.NAMES)
    again = C.Certificate.from_tensors(tensors)
    assert all(torch.equal(getattr(again, n), getattr(certificate, n)) for n in C.NAMES)
    assert C.Certificate.from_tensors({"hidden_states": layers[0]}) is None


def test_a_probed_position_is_allowed_a_recomputations_difference_the_rows_own_is_not(head):
    """A state off by a few bounds (as a second forward of the prefix may be, in bfloat16) passes at a
    probed position and fails at the row's own; a wrong state fails at either."""
    state = states(1, 32, seed=3)[0]
    ids, logprobs = engine_logprobs(head, state, POSITIONS)
    alone = C.agreement(head, state[POSITIONS], ids, logprobs, state_unit=BF16, engine_unit=BF16)
    nudged = logprobs + 4 * alone.bound.view(-1, 1)  # four bounds off at every position
    strict = C.agreement(head, state[POSITIONS], ids, nudged, state_unit=BF16, engine_unit=BF16)
    assert strict.failing == [0, 1, 2, 3, 4]
    probed = C.agreement(head, state[POSITIONS], ids, nudged, state_unit=BF16, engine_unit=BF16,
                         slack=torch.tensor([C.PROBE_SLACK] * 4 + [1.0]))
    assert probed.failing == [4]
    other = states(1, 32, seed=4)[0]
    wrong = C.agreement(head, other[POSITIONS], ids, logprobs, state_unit=BF16, engine_unit=BF16,
                        slack=torch.full((5,), C.PROBE_SLACK))
    assert wrong.failing == [0, 1, 2, 3, 4]


def test_a_certificate_takes_one_copy_to_the_heads_device_and_one_back(head):
    # On a GPU that vLLM's engine keeps busy, each copy from this process waits for its turn on the GPU
    # and costs the engine's step a switch: the positions' states and everything else go in one copy.
    # The head here lives on the meta device (shapes only), and every copy between devices is counted.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made: list[tuple[str, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and "device" in kwargs:
                source, target = args[0].device.type, torch.device(kwargs["device"]).type
                if source != target:
                    self.made.append((source, target))
                    if source == "meta":  # what comes back: the shapes are what this test reads
                        return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            return func(*args, **kwargs)

    elsewhere = FinalHead(head.norm.to("meta"), head.eps, head.weight.to("meta"))
    elsewhere.squared  # noqa: B018 - made once per run, at the first certificate (not counted here)
    state = states(1, 40, seed=3)[0]
    ids, logprobs = engine_logprobs(head, state, POSITIONS)
    with Copies() as copies:
        found = C.agreement(elsewhere, state[POSITIONS], ids, logprobs, state_unit=torch.full((5, 1), BF16),
                            engine_unit=BF16, state_floor=torch.zeros(5), slack=torch.ones(5))
    assert copies.made == [("cpu", "meta"), ("meta", "cpu")]
    assert found.error.shape == found.bound.shape == (5,)
