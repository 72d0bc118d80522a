"""The run's certifier: each row's certificate made from its written states and the engine's witness
before the row goes to the writer; a row that fails stops the run before it is written."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from .. import fp8_states
from .certificate import Agreement, Certificate, agreement, roundings, sketch
from .head import FinalHead, Uncertifiable, model_config
from .witness import Witness, probe_positions

CHECK_TOKENS = 48  # the sequence certified at load: three blocks of vLLM's prefix cache, a probe inside
HEAD_SPARE = 2 ** 30  # bytes a GPU keeps beside the head (the products of a batch's positions, CUDA's own)


def head_device(model_path: str, log) -> str:
    """Where the head runs: a GPU's first, where this process sees one with room for it (a batch's
    certificates are two products with the LM head: a CPU falls behind an 8B's rows), else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    config = model_config(Path(model_path))
    needs = 2 * 4 * config.get("vocab_size", 0) * config.get("hidden_size", 0) + HEAD_SPARE  # FinalHead.squared
    free, _ = torch.cuda.mem_get_info(0)
    return "cuda:0" if free > needs else _said(log, f"certificates: the head runs on the CPU: it needs "
                                                    f"{needs / 2**30:.1f} GiB, cuda:0 has {free / 2**30:.1f} GiB free")


def _said(log, line: str) -> str:
    log(line)
    return "cpu"


def uncertified_hint(backend: str, output_dir) -> str:
    """What a run whose backend writes rows without certificates says of them: the command that
    certifies them after it (``verify_engine``)."""
    return (f"certificates: not during the run with --backend {backend}: hidden-states verify {output_dir or 'OUT'} "
            f"--engine certifies its rows after it (--backend vllm-engine certifies them as it writes them)")


class CertificateFailed(RuntimeError):
    """A row's written last-layer state is not what the engine computed: the row, the positions and
    the numbers."""


def write_certified(certifier: Certifier | None, rows: list, write) -> None:
    """Hand each of ``rows`` (``(row, layers, witness)``, in order) to ``write(row, layers, extra)``,
    ``extra`` its certificate's tensors, all of them certified first in one pass (``certifier`` None:
    none, written as they are). The rows before a failing one are written; the failing one raises its
    :class:`CertificateFailed`, and neither it nor those after it are written."""
    certificates = certifier.certify_all(rows) if certifier is not None and rows else [None] * len(rows)
    for (row, layers, _), certificate in zip(rows, certificates, strict=True):
        if isinstance(certificate, CertificateFailed):
            raise certificate
        write(row, layers, certificate.tensors() if certificate is not None else None)


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
        # the largest error over its bound so far: at rows' own positions (their states' forward), at probes
        self.worst_own = self.worst_probed = 0.0
        self._counting = threading.Lock()  # serve's writer threads certify side by side

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
            head = FinalHead.load(model_path, head_device(model_path, log))
        except Uncertifiable as exc:
            log(f"certificates: off: {exc}")
            return None
        return cls(head, written_ids.index(last), fp8=state_dtype == "fp8")

    @classmethod
    def for_model(cls, settings, plan, backend, layer_order: list[int], log):
        """The certifier of a loaded model (``settings``: the run's; ``plan``: ``planner.ModelPlan``),
        its first certificate made (:meth:`check_at_load`); or None, said in one line, where the
        rows go uncertified."""
        if not settings.certificates:
            log("certificates: off (--no-certificates): rows are written without the proof of their states")
            return None
        if not backend.certifies:
            log(uncertified_hint(settings.backend, getattr(settings, "output_dir", None)))
            return None
        certifier = cls.for_run(settings.model_path, list(plan.layers.ids), plan.facts.num_layers,
                                settings.state_dtype, log)
        if certifier is not None:
            certifier.check_at_load(backend, layer_order, plan.facts.vocab_size, log, settings.max_seq_len)
        return certifier

    def check_at_load(self, backend, layer_order: list[int], vocab_size: int, log, max_seq_len: int) -> None:
        """One sequence certified before the first row: vLLM's logprobs path runs once (it compiles a
        kernel on first use: seconds spent in the load, not in the run's rate), and a capture wrong
        for every request stops the run here, with nothing written (raises :class:`CertificateFailed`)."""
        started = time.monotonic()
        # any ids: the weights are what is checked; no longer than a row may be (vLLM refuses a longer one)
        ids = [(11 + 37 * i) % vocab_size for i in range(min(CHECK_TOKENS, max_seq_len))]
        layers, witness = backend.submit_certified([ids], [probe_positions(ids)]).result()[0]
        found = self.certify_all([("a sequence certified at load, before the first sample",
                                   fp8_states.pick(layers, layer_order), witness.result())])[0]
        if isinstance(found, CertificateFailed):
            raise CertificateFailed(f"{str(found).removesuffix('; not written')}; every row would fail so: "
                                    f"nothing was written")
        worst, self.rows, self.worst_own, self.worst_probed = self.worst, 0, 0.0, 0.0
        log(f"certificates: on: every row is checked against the engine's logprobs before it is written "
            f"(a check sequence at load: {worst:.2f} of what rounding explains, {time.monotonic() - started:.1f} s)")

    @property
    def worst(self) -> float:
        """The largest error over its bound of every position certified so far."""
        return max(self.worst_own, self.worst_probed)

    def said(self) -> str:
        """The run's certificates in a line's words: how many, and how near their bounds."""
        return (f"{self.rows:,} rows certified, the largest disagreement with the engine {self.worst:.2f} of what "
                f"rounding explains ({self.worst_own:.2f} at rows' own positions, {self.worst_probed:.2f} at probes)")

    def certify(self, row, layers: list, witness: Witness) -> Certificate:
        """``row``'s certificate from its ``layers`` (as the writer gets them) and the engine's
        ``witness``; raises :class:`CertificateFailed` where they disagree past the bound."""
        found = self.certify_all([(row, layers, witness)])[0]
        if isinstance(found, CertificateFailed):
            raise found
        return found

    def certify_all(self, rows: list) -> list:
        """Each of ``rows`` (``(row, layers, witness)``) certified: its :class:`Certificate`, or the
        :class:`CertificateFailed` that stops the run at it. One pass through the head for all of them:
        a batch's positions in one product with the LM head, not a small one per row."""
        import torch

        read = [self._read(layers, witness) for _, layers, witness in rows]
        counts = [len(r["positions"]) for r in read]
        width = max((r["token_ids"].shape[1] for r in read), default=0)

        def padded(name, fill):
            return torch.cat([torch.nn.functional.pad(r[name], (0, width - r[name].shape[1]), value=fill)
                              for r in read])

        def per_position(name):
            return torch.cat([torch.as_tensor(r[name], dtype=torch.float32).expand(count).reshape(-1, 1)
                              for r, count in zip(read, counts, strict=True)])

        found = agreement(self.head, torch.cat([r["rows"][self.last_index] for r in read]), padded("token_ids", -1),
                          padded("logprobs", 0.0), state_unit=per_position("state_unit"),
                          engine_unit=per_position("engine_unit"), state_floor=per_position("floor"),
                          slack=torch.cat([r["slack"] for r in read]))
        results, start = [], 0
        for (row, _, _), r, count in zip(rows, read, counts, strict=True):
            own = Agreement(found.error[start:start + count], found.bound[start:start + count])
            start += count
            probed = r["slack"] > 1
            with self._counting:
                self.rows += 1
                self.worst_own = max(self.worst_own, Agreement(own.error[~probed], own.bound[~probed]).worst)
                self.worst_probed = max(self.worst_probed, Agreement(own.error[probed], own.bound[probed]).worst)
            results.append(self._failed(row, r["positions"], own) if own.failing else
                           Certificate(r["positions"], r["token_ids"], r["logprobs"], own.error.float(),
                                       sketch(r["rows"]), r["slack"]))
        return results

    def _read(self, layers: list, witness: Witness) -> dict:
        """A row's written states at its witness's positions, as the trainer reads them (on the CPU), and
        the roundings that explain a difference there."""
        positions, token_ids, logprobs, slack = witness.tensors()
        rows = [layer[positions.to(layer.device)] for layer in layers]
        scales = None
        if isinstance(layers, fp8_states.Quantized):
            scales = layers.scales[positions.to(layers.scales.device)].view(-1, 1)
            rows = [fp8_states.dequantize(r, scales) for r in rows]
        elif self.fp8:  # quantized by the format on a writer thread: the same values, at these positions
            quantized, scales = fp8_states.quantize(rows)
            scales = scales.view(-1, 1)
            rows = [fp8_states.dequantize(r, scales) for r in quantized]
        state_unit, engine_unit, floor = roundings(layers[0].dtype, scales)
        return {"positions": positions, "token_ids": token_ids.long(), "logprobs": logprobs.float(), "slack": slack,
                "rows": [r.cpu() for r in rows], "state_unit": state_unit, "engine_unit": engine_unit, "floor": floor}

    @staticmethod
    def _failed(row, positions, found: Agreement) -> CertificateFailed:
        """``row``: a sample (named by its index and line), or a string naming what it is."""
        failing = found.failing
        said = ", ".join(f"position {int(positions[i])}: {float(found.error[i]):.3g} > {float(found.bound[i]):.3g}"
                         for i in failing[:4])
        named = row if isinstance(row, str) else f"sample {row.index} ({row.where})"
        return CertificateFailed(f"{named}: its written last-layer state is not the "
                                 f"engine's ({said}{', ...' if len(failing) > 4 else ''}: |our logprob - the "
                                 f"engine's| past what rounding explains, {found.worst:.0f}x); not written")
