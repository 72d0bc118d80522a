"""The run's certifier: each row's certificate made from its written states and the engine's witness
before the row goes to the writer; a row that fails stops the run before it is written."""
from __future__ import annotations

from .. import fp8_states
from .certificate import HALF_ULP, Certificate, certify
from .head import FinalHead, Uncertifiable
from .witness import Witness

FP8_SUBNORMAL = 2.0 ** -10  # half e4m3fn's smallest subnormal: a value's absolute rounding, times its scale


class CertificateFailed(RuntimeError):
    """A row's written last-layer state is not what the engine computed: the row, the positions and
    the numbers."""


class Certifier:
    """Certifies rows for one run.

    Args:
        head: the checkpoint's final norm and LM head.
        last_index: where the last decoder layer is among a row's written layers.
        fp8: the rows are written as FP8 with a scale per token (the format quantizes what is not yet).
    """

    def __init__(self, head: FinalHead, last_index: int, fp8: bool = False):
        self.head, self.last_index, self.fp8 = head, last_index, fp8
        self.rows = 0
        self.worst = 0.0  # the largest error over its bound of every row certified so far

    @classmethod
    def for_run(cls, model_path: str, written_ids: list[int], num_layers: int, state_dtype: str, log):
        """The certifier of a run writing layers ``written_ids`` (the extractor's convention), or None,
        said in one line, where its rows cannot be certified."""
        last = num_layers - 1
        if last not in written_ids:
            log(f"certificates: off: the last decoder layer (id {last} as the extractor counts) is not among the "
                f"written layers {written_ids}; its state is what a certificate checks")
            return None
        try:
            head = FinalHead.load(model_path)
        except Uncertifiable as exc:
            log(f"certificates: off: {exc}")
            return None
        return cls(head, written_ids.index(last), fp8=state_dtype == "fp8")

    def certify(self, row, layers: list, witness: Witness) -> Certificate:
        """``row``'s certificate from its ``layers`` (as the writer gets them) and the engine's
        ``witness``; raises :class:`CertificateFailed` where they disagree past the bound."""
        positions, token_ids, logprobs = witness.tensors()
        rows = [layer[positions.to(layer.device)] for layer in layers]
        scales = None
        if isinstance(layers, fp8_states.Quantized):
            scales = layers.scales[positions.to(layers.scales.device)].view(-1, 1)
            rows = [fp8_states.dequantize(r, scales) for r in rows]
        elif self.fp8:  # quantized by the format on a writer thread: the same values, at these positions
            quantized, scales = fp8_states.quantize(rows)
            scales = scales.view(-1, 1)
            rows = [fp8_states.dequantize(r, scales) for r in quantized]
        if scales is not None:  # FP8's rounding, and where its values go subnormal an absolute floor
            state_unit, floor = HALF_ULP["float8_e4m3fn"], scales.view(-1).float().cpu() * FP8_SUBNORMAL
            engine_unit = HALF_ULP["bfloat16"]  # FP8 rows do not say the engine's dtype: the coarsest it runs
        else:  # the engine's own states, in its dtype (an unknown one counted as the coarsest)
            state_unit = engine_unit = HALF_ULP.get(str(layers[0].dtype).removeprefix("torch."), HALF_ULP["bfloat16"])
            floor = 0.0
        rows = [r.cpu() for r in rows]
        certificate, found = certify(self.head, rows, self.last_index, positions, token_ids, logprobs,
                                     state_unit=state_unit, engine_unit=engine_unit, state_floor=floor)
        self.rows += 1
        self.worst = max(self.worst, found.worst)
        failing = found.failing
        if failing:
            said = ", ".join(f"position {int(positions[i])}: {float(found.error[i]):.3g} > {float(found.bound[i]):.3g}"
                             for i in failing[:4])
            raise CertificateFailed(f"sample {row.index} ({row.where}): its written last-layer state is not the "
                                    f"engine's ({said}{', ...' if len(failing) > 4 else ''}: |our logprob - the "
                                    f"engine's| past what rounding explains, {found.worst:.0f}x); not written")
        return certificate
