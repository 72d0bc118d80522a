"""What :func:`vllm_compat.apply` did, adapter by adapter, as values (never exceptions)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

APPLIED = "applied"
ARMED = "armed"  # deferred: patched when its module is imported
NOT_NEEDED = "not_needed"
DISABLED = "disabled"
UNKNOWN_DRIFT = "unknown_drift"
FAILED = "failed"
STATUSES = (APPLIED, ARMED, NOT_NEEDED, DISABLED, UNKNOWN_DRIFT, FAILED)


@dataclass(frozen=True)
class AdapterResult:
    """One adapter's outcome.

    Attributes:
        id: the adapter id.
        status: one of ``STATUSES``.
        reason: one line, e.g. "needed for vllm 0.17.0, probe found parameter ... absent".
        scope: the adapter's scope.
        where: file:line of the probed object, when known.
        unverified: "not verified on vllm X (verified through Y)" when the installed vLLM is newer
            than the newest release the adapter was verified on; empty otherwise.
    """

    id: str
    status: str
    reason: str
    scope: str = ""
    where: str = ""
    unverified: str = ""

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        warning = f" [{self.unverified}]" if self.unverified else ""
        return f"{self.id}: {self.status} - {self.reason}{where}{warning}"


@dataclass(frozen=True)
class Report:
    """All results of one :func:`~vllm_compat.apply` (or the live :func:`~vllm_compat.status`)."""

    vllm_version: str | None
    speculators_version: str | None
    results: tuple[AdapterResult, ...] = field(default=())
    pid: int = 0
    role: str = "parent"
    newest_verified: str | None = None  # the newest vLLM release every adapter was verified on

    def by_status(self, status: str) -> list[AdapterResult]:
        return [r for r in self.results if r.status == status]

    @property
    def applied(self) -> list[str]:
        return [r.id for r in self.results if r.status in (APPLIED, ARMED)]

    @property
    def unknown_drift(self) -> list[AdapterResult]:
        return self.by_status(UNKNOWN_DRIFT)

    @property
    def unverified(self) -> list[AdapterResult]:
        return [r for r in self.results if r.unverified]

    @property
    def failed(self) -> list[AdapterResult]:
        return self.by_status(FAILED)

    def __getitem__(self, adapter_id: str) -> AdapterResult:
        for result in self.results:
            if result.id == adapter_id:
                return result
        raise KeyError(adapter_id)

    def summary(self) -> str:
        counts = ", ".join(f"{len(self.by_status(s))} {s}" for s in STATUSES if self.by_status(s))
        unverified = f", {len(self.unverified)} not verified on this vLLM" if self.unverified else ""
        return (
            f"vllm-compat ({self.role}, pid {self.pid}): vllm {self.vllm_version or 'not installed'} "
            f"(newest verified: {self.newest_verified or 'none'}), "
            f"speculators {self.speculators_version or 'not installed'}: {counts or 'no adapters'}{unverified}"
        )

    def __str__(self) -> str:
        return "\n".join([self.summary(), *(f"  {r}" for r in self.results)])

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
