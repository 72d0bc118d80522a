"""``python -m hidden_states.train`` (the documented training command) with each step's loss written
down, for the tests to judge:

    python trainer_driver.py RESULT.json <hidden_states.train flags>

Run in a subprocess with one speculators release first on ``PYTHONPATH``. The losses are read from
the trainer's own metric logger (``speculators.metrics``), where its ``train_epoch`` reports every step;
both releases' ``setup_metric_logger`` replace that logger's handlers, so ours is added again after.
"""
from __future__ import annotations

import json
import logging
import logging.config
import sys

from hidden_states import train


class StepLosses(logging.Handler):
    """Collects ``{"train": {...}}`` records of the ``speculators.metrics`` logger."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.steps.append({k: float(v) for k, v in record.msg["train"].items() if isinstance(v, (int, float))})


def listen_after_setup(losses: StepLosses) -> None:
    """Re-adds ``losses`` after every ``dictConfig``: both releases' ``setup_metric_logger`` configure
    the logger so (``from logging.config import dictConfig``, bound when speculators is imported, which
    is after this)."""
    configure = logging.config.dictConfig

    def configure_then_listen(config):
        configure(config)
        logging.getLogger("speculators.metrics").addHandler(losses)

    logging.config.dictConfig = configure_then_listen


def main() -> int:
    result, argv = sys.argv[1], sys.argv[2:]
    losses = StepLosses()
    listen_after_setup(losses)
    code = train.main(argv)
    with open(result, "w") as handle:
        json.dump(losses.steps, handle)
    return code


if __name__ == "__main__":
    sys.exit(main())
