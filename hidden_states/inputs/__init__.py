"""The input side: the input's rows, read and tokenized into samples, and what they were made from.

* ``conversations.py``: the containers an input comes in (JSONL, a JSON array, Parquet, a saved
  dataset) and their rows, kinds and roles;
* ``tokenization.py``: conversations to token ids and loss masks with the model's chat template;
  the token frequencies of what is trained;
* ``streams.py``: :class:`streams.InputStream`, the input's samples streamed and validated;
* ``identity.py``: what the samples were made from (the input's path, size and hash, the
  tokenization settings), recorded in the output directory and compared by every rerun;
* ``prefixes.py``: rows whose tokens begin a longer row of the same batch, written from its states.
"""
