"""Injected into an extractor subprocess (PYTHONPATH) to simulate a full disk: after
ENOSPC_AFTER hidden-state files have been saved, saving the next one fails with ENOSPC, as the OS
reports it (torch writes through its C++ zip writer, so the hook sits on torch.save). With
DISK_FREE (bytes) and DISK_FREE_UNDER (a folder), the paths under that folder report that much free
space (``shutil.disk_usage``, which the preflight asks): the disk a run filled, on which the next one
resumes (other disks, /dev/shm which vLLM checks, as they are)."""
import errno
import os
import shutil

import wrapt

if os.environ.get("DISK_FREE"):
    _disk_usage = shutil.disk_usage

    def _filled_disk(path):
        usage = _disk_usage(path)
        under = os.path.realpath(os.environ["DISK_FREE_UNDER"])
        if os.path.commonpath([os.path.realpath(path), under]) != under:
            return usage
        return usage._replace(free=int(os.environ["DISK_FREE"]))

    shutil.disk_usage = _filled_disk

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
