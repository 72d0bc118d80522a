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
removes this server's files older than the time limit; another server's files (their names carry
another token) are never touched, whatever shares the directory.

On a shared host the directory is private: by default one per user (:func:`default_directory`),
created 0700, and an existing one is used only when it belongs to the user and no one else may write
in it (:func:`private_directory`). Files are created exclusively, without following a link, mode 0600:
the names are predictable (the token is in every served name), so nothing may be planted under them.
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from pathlib import Path

from ..errors import UsageError
from ..files import describe_os_error
from ..output.formats.safetensors_files import state_tensors, write_safetensors

TEMP_PREFIX = ".tmp-"
# exclusive, never through a link planted under the name, not inherited by vLLM's processes
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
FILE_MODE = 0o600  # the training prompts, as token ids: for the server's user alone


def default_directory(environ=os.environ) -> Path:
    """Where served files wait by default: ``$XDG_RUNTIME_DIR/hidden-states`` when that runtime
    directory exists and is the user's own, else ``<tmp>/hidden-states-<uid>``: one per user, never a
    name another user's server shares."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            info = os.stat(runtime)
        except OSError:
            info = None
        if info is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() \
                and not info.st_mode & 0o022:
            return Path(runtime) / "hidden-states"
    return Path(tempfile.gettempdir()) / f"hidden-states-{os.geteuid()}"


def private_directory(directory: Path, flag: str = "--states-dir") -> Path:
    """``directory``, made 0700 when missing; an existing one only when it is a directory of this user
    that neither group nor others may write in (else another user could plant or remove files in it).
    :class:`UsageError` naming it otherwise."""
    directory = Path(directory)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"{flag} {directory}: {exc.strerror or exc}") from None
    try:
        link = os.lstat(directory)
        info = os.stat(directory)
    except OSError as exc:
        raise UsageError(f"{flag} {directory}: {exc.strerror or exc}") from None
    user = os.geteuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid != user:
        raise UsageError(f"{flag} {directory}: a link owned by uid {link.st_uid}, not by this user (uid {user}); "
                         f"give a directory of your own")
    if not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{flag} {directory}: not a directory")
    if info.st_uid != user:
        raise UsageError(f"{flag} {directory}: owned by uid {info.st_uid}, not by this user (uid {user}); "
                         f"another user could read or replace the served files: give a directory of your own")
    if info.st_mode & 0o022:
        who = "others" if info.st_mode & 0o002 else "its group"
        raise UsageError(f"{flag} {directory}: writable by {who} "
                         f"(mode {stat.S_IMODE(info.st_mode):o}); another user could plant or remove files in it: "
                         f"chmod go-w it or give a private directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {directory}: not writable")
    return directory


class StateFiles:
    """Writes served files into ``directory`` and sweeps the ones left there.

    Args:
        directory: where the files go (made if missing); on the client's filesystem, best the one its
            output is on: the client's move is then a rename.
        state_dtype: ``model`` or ``fp8`` (``fp8_states.STATE_DTYPES``).
        sweep_after: seconds a served file may wait for its client before :meth:`sweep` removes it.
        log: one line per message (a sweep that failed).
        flag: how an error names the directory (``--states-dir``, or the default's words).
    """

    def __init__(self, directory: Path, state_dtype: str, sweep_after: float, log=None, flag: str = "--states-dir"):
        self.directory = private_directory(Path(directory), flag)
        self.state_dtype = state_dtype
        self.sweep_after = sweep_after
        self.log = log or (lambda line: None)
        self._token = secrets.token_hex(4)  # two servers on one directory never share a name
        # its files' names: this token, then a counter (never ``hs_*``: the client's own names)
        self._own = re.compile(rf"^(?:{re.escape(TEMP_PREFIX)})?served-{self._token}-\d+\.safetensors$")
        self._numbers = itertools.count()
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.swept = 0

    def write(self, token_ids: list[int], layers: list, extra: dict | None = None) -> Path:
        """One request's file: ``layers`` (one ``[n, hidden]`` per layer, or ``fp8_states.Quantized``),
        ``token_ids`` and any ``extra`` tensors (its certificate), written under a temporary name, then
        renamed into place. Returns its path."""
        import torch

        tensors = {**state_tensors(layers, self.state_dtype),
                   "token_ids": torch.as_tensor(token_ids, dtype=torch.long), **(extra or {})}
        final = self.directory / f"served-{self._token}-{next(self._numbers)}.safetensors"
        temp = final.with_name(f"{TEMP_PREFIX}{final.name}")
        created = False
        try:
            with os.fdopen(os.open(temp, CREATE_FLAGS, FILE_MODE), "wb") as handle:
                created = True
                write_safetensors(tensors, handle)
            if os.path.lexists(final):  # planted under this server's next name: never replaced
                raise FileExistsError(errno.EEXIST, "something else is already there", str(final))
            os.replace(temp, final)
        except OSError as exc:
            if created:  # (never a link or file planted under the temporary name: not this server's)
                temp.unlink(missing_ok=True)
            raise OSError(exc.errno, describe_os_error(exc, final)) from None
        return final

    def sweep(self, now: float | None = None) -> int:
        """Remove this server's files (and its temporary ones) older than ``sweep_after`` seconds;
        returns how many. Anything else in the directory is left alone, whatever its name or kind."""
        cutoff = (time.time() if now is None else now) - self.sweep_after
        removed = 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not self._own.match(entry.name):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:  # the client collected it meanwhile
                    continue
                except OSError as exc:
                    self.log(f"sweep: {entry.path} left: {exc.strerror or exc}")
        self.swept += removed
        return removed

    def start_sweeping(self, interval: float | None = None) -> None:
        """Sweep now and then every ``interval`` seconds (a tenth of the limit by default) on a thread;
        a sweep that fails is said and the next one runs (the thread never ends but by :meth:`stop`)."""
        self.sweep()
        interval = interval or max(self.sweep_after / 10, 1.0)

        def run():
            while not self._stop.wait(interval):
                try:
                    self.sweep()
                except Exception as exc:  # noqa: BLE001 - one failed sweep must not end the sweeping
                    self.log(f"sweep of {self.directory} failed, next in {interval:g} s: "
                             f"{type(exc).__name__}: {exc or '(no message)'}")

        self._sweeper = threading.Thread(target=run, name="hidden-states-sweeper", daemon=True)
        self._sweeper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
