"""Run speculators' own conversation preprocessing on a JSONL file and print its rows in the file's
order, for tests/e2e/test_conversations.py (run in a subprocess with one speculators release on
PYTHONPATH, and ``datasets``).

    python speculators_prep_driver.py 0.4 JOBS.json    # [{"tokenizer", "data", "seq_len", "out"}, ...]

(one process per release: importing speculators, transformers and datasets takes most of a run)

0.3 / 0.4: ``load_and_preprocess_dataset`` as released (it shuffles with ``seed``; the rows are put
back in the file's order by the permutation the same shuffle of the same file makes), ``token_freq.pt`` as
it writes it. 0.9: its ``prepare-data`` steps, ``load_raw_dataset`` then
``build_speculator_training_dataset`` (without the shuffles, which a fan-out of one row per turn
makes impossible to undo), each render done by the tokenizer's ``apply_chat_template`` where 0.9
asks a vLLM server's ``/render`` (which renders with the same template and tokenizes without
special tokens, truncated on the right); ``token_freq.pt`` by its
``save_token_frequency_distribution``. Writes ``rows.jsonl`` and ``token_freq.pt`` in OUT_DIR.
"""
import json
import sys
from pathlib import Path


def main(release: str, jobs: str) -> None:
    import vllm_compat

    vllm_compat.apply()  # speculators 0.3/0.4 import under transformers 5 only with the shim
    import datasets

    datasets.disable_progress_bars()
    for job in json.loads(Path(jobs).read_text()):
        run(release, job["tokenizer"], job["data"], job["seq_len"], Path(job["out"]))


def run(release: str, tokenizer_dir: str, data: str, seq_len: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if release in ("0.3", "0.4"):
        from speculators.data_generation.preprocessing import load_and_preprocess_dataset, load_raw_dataset

        dataset, _ = load_and_preprocess_dataset(tokenizer_dir, data, seq_len, build_dataset_num_proc=1, seed=0,
                                                 token_freq_path=str(out / "token_freq.pt"),
                                                 cache_dir=str(out / "cache"))
        rows = sum(1 for line in open(data) if line.strip())
        # the permutation its shuffle applied: the same call on the same file (datasets keeps it as
        # the shuffled dataset's indices mapping)
        order = load_raw_dataset(data, num_proc=1).shuffle(seed=0)._indices.column(0).to_pylist()
        assert len(dataset) == rows, f"{len(dataset)} rows from {rows} conversations"
        by_source = {source: dataset[k] for k, source in enumerate(order)}
        made = [by_source[i] for i in range(rows)]
    else:
        from transformers import AutoTokenizer

        from speculators.data_generation import preprocessing
        from speculators.train.vocab_mapping import save_token_frequency_distribution

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

        def render(endpoint, messages, *, add_generation_prompt, tools=None, truncate_prompt_tokens=None,
                   truncation_side=None, **_):
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return ids[:truncate_prompt_tokens] if truncate_prompt_tokens is not None else ids

        preprocessing.render_conversation = render
        raw, _ = preprocessing.load_raw_dataset(data)
        dataset = preprocessing.build_speculator_training_dataset(raw, tokenizer, max_length=seq_len, num_proc=1,
                                                                  render_endpoint="local")
        save_token_frequency_distribution(dataset, str(out / "token_freq.pt"))
        made = [dataset[k] for k in range(len(dataset))]
    with open(out / "rows.jsonl", "w") as handle:
        for row in made:
            handle.write(json.dumps({"input_ids": row["input_ids"].tolist(), "loss_mask": row["loss_mask"].tolist()})
                         + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
