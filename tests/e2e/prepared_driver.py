"""Write a speculators 0.9 prepared dataset (what its ``prepare-data`` leaves: ``input_ids``, ``loss_mask``,
``seq_len``, torch format) from a JSON list of token-id rows, every token trained.

    python prepared_driver.py ROWS.json OUT_DIR

Run with speculators 0.9's folder (its ``datasets``) on ``PYTHONPATH`` (tests/e2e/test_serve.py,
bench/serve.py). Built from a generator, as the extractor builds its dataset index: ``datasets``'
fingerprint of an in-memory table (``from_dict``) fails on the pyarrow that folder holds.
"""
import json
import sys

import datasets


def rows(path: str):
    for row in json.load(open(path)):
        yield {"input_ids": row, "loss_mask": [1] * len(row), "seq_len": len(row)}


def main() -> int:
    source, target = sys.argv[1], sys.argv[2]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    dataset = datasets.Dataset.from_generator(rows, gen_kwargs={"path": source}, features=features,
                                              cache_dir=target + ".cache")
    dataset.set_format("torch")
    dataset.save_to_disk(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
