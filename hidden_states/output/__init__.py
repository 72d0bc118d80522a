"""The output directory, written so nothing is ever lost, whatever the format (``formats/``).

* the format's sample files, one per sample index (``data_{i}.pt`` for speculators 0.3/0.4);
* ``done.jsonl``: the resume ledger, one ``{"index": i, "length": n}`` line per finished sample
  (``done.<tag>.jsonl`` for a writer with a tag: each static shard and each data-parallel replica
  appends to a ledger of its own, so no two processes, maybe on two hosts, append to one file; a
  rerun reads them all, whatever mix of writers produced the files);
* ``data_config.json``: model, layer ids, package versions, the vllm-compat adapters applied, the
  format's own description, and what the samples were made from (``inputs/identity.py``: the input's
  path, size and hash, the tokenization settings), written before the first sample; a run into a
  directory holding another extraction with finished samples is refused (``OutputDir.check``);
* whatever index files the format writes when a run ends (``sample_lengths.json``);
* ``token_freq.pt`` (``TOKEN_FREQ``), for an input of conversations, once a run has read every row,
  in a layout whose trainer reads it (a format's ``token_frequencies_file``: speculators-0.5; never
  beside speculators-0.3's samples, whose trainer would load it as one).

Every file is written under a temporary name and renamed into place, so a final name always holds
a whole file. A background thread does the writing from a bounded queue: the model never waits on
disk unless the disk is slower than extraction, and that wait is measured (``stall_seconds``).
The ledger line is written after the rename; a rerun skips every sample whose file exists and ends
whole (files are not fsync'ed, for speed: after a power cut a renamed file whose data never reached
the disk can be empty or cut short, and is redone).

The modules: ``names.py`` (the names above), ``directory.py`` (:class:`directory.OutputDir`: checked
against the run's identity, prepared, its finished samples read), ``writer.py``
(:class:`writer.BackgroundWriter`, its ledger), ``lock.py`` (one run at a time), ``formats/`` (a
format is a writer of sample files).
"""
