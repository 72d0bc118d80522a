"""The files ``hidden-states serve`` answers with: one safetensors file per request, whole under its
final name before the reply names it, removed when nobody collected it.

speculators 0.9's client takes the reply's ``kv_transfer_params.hidden_states_path`` and moves the file
to ``hs_{idx}.safetensors`` (``generate-offline-data``) or loads and deletes it (its trainer's
``--on-missing generate``); it first waits up to 10 s on ``<path>.lock`` if one exists
(``data_generation/vllm_client.py``, ``hs_connectors/transfer.py`` in 0.9.0). Here a file is written
under a hidden temporary name and renamed into place before the reply: no lock is ever needed.

A file holds ``hidden_states`` ``[n, layers, hidden]`` and int64 ``token_ids`` ``[n]`` (what
``check_hidden_states`` reads), and with FP8 states ``hidden_states_scales`` ``[n, 1, 1]``
(``fp8_states``): the speculators-0.5 sample file less its ``loss_mask``, which a server does not know.
A client that dies between the reply and the move leaves its file behind: :meth:`StateFiles.sweep`
removes served files older than the time limit, and runs at start too (a previous server's).
"""
from __future__ import annotations

import itertools
import os
import re
import secrets
import threading
import time
from pathlib import Path

from .errors import UsageError
from .formats.speculators_05 import state_tensors, write_safetensors
from .output import describe_os_error

TEMP_PREFIX = ".tmp-"
# a served file's name: this server's token, then a counter (never ``hs_*``: the client's own names)
SERVED = re.compile(r"^served-[0-9a-f]+-\d+\.safetensors$")


class StateFiles:
    """Writes served files into ``directory`` and sweeps the ones left there.

    Args:
        directory: where the files go (made if missing); on the client's filesystem, best the one its
            output is on: the client's move is then a rename.
        state_dtype: ``model`` or ``fp8`` (``fp8_states.STATE_DTYPES``).
        sweep_after: seconds a served file may wait for its client before :meth:`sweep` removes it.
    """

    def __init__(self, directory: Path, state_dtype: str, sweep_after: float):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--states-dir {directory}: {exc.strerror or exc}") from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise UsageError(f"--states-dir {directory}: not writable")
        self.state_dtype = state_dtype
        self.sweep_after = sweep_after
        self._token = secrets.token_hex(4)  # two servers on one directory never share a name
        self._numbers = itertools.count()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.swept = 0

    def write(self, token_ids: list[int], layers: list) -> Path:
        """One request's file: ``layers`` (one ``[n, hidden]`` per layer, or ``fp8_states.Quantized``)
        and ``token_ids``, written under a temporary name, then renamed into place. Returns its path."""
        import torch

        tensors = {**state_tensors(layers, self.state_dtype),
                   "token_ids": torch.as_tensor(token_ids, dtype=torch.long)}
        final = self.directory / f"served-{self._token}-{next(self._numbers)}.safetensors"
        temp = final.with_name(f"{TEMP_PREFIX}{final.name}")
        try:
            with open(temp, "wb") as handle:
                write_safetensors(tensors, handle)
            os.replace(temp, final)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise OSError(exc.errno, describe_os_error(exc, final)) from None
        return final

    def sweep(self, now: float | None = None) -> int:
        """Remove served files (and temporary ones) older than ``sweep_after`` seconds; returns how many."""
        cutoff = (time.time() if now is None else now) - self.sweep_after
        removed = 0
        for path in self.directory.iterdir():
            name = path.name.removeprefix(TEMP_PREFIX)
            if not SERVED.match(name):
                continue
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # the client collected it meanwhile
                continue
        self.swept += removed
        return removed

    def start_sweeping(self, interval: float | None = None) -> None:
        """Sweep now and then every ``interval`` seconds (a tenth of the limit by default) on a thread."""
        self.sweep()
        interval = interval or max(self.sweep_after / 10, 1.0)

        def run():
            while not self._stop.wait(interval):
                self.sweep()

        self._sweeper = threading.Thread(target=run, name="hidden-states-sweeper", daemon=True)
        self._sweeper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
