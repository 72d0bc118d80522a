"""Injected into an extractor subprocess (PYTHONPATH) to simulate a full disk: after
ENOSPC_AFTER hidden-state files have been saved, saving the next one fails with ENOSPC, as the OS
reports it (torch writes through its C++ zip writer, so the hook sits on torch.save)."""
import errno
import os

import wrapt

_saved = {"files": 0}
_limit = int(os.environ.get("ENOSPC_AFTER", "0"))


def _full_disk(wrapped, instance, args, kwargs):
    file = args[1] if len(args) > 1 else kwargs.get("f", "")
    target = os.path.basename(str(getattr(file, "name", file)))  # a path, or the file object it is written through
    if target.startswith(".tmp-data_"):
        if _saved["files"] >= _limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)
        _saved["files"] += 1
    return wrapped(*args, **kwargs)


@wrapt.when_imported("torch")
def _patch(torch):
    wrapt.wrap_function_wrapper(torch, "save", _full_disk)
