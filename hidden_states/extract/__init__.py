"""``hidden-states extract``: the input's samples to the output format's files, with the states of
the layers asked (docs/guides/extract.md). ``command.py``: the run (plan, prepare, the loop, on this
process or on Ray replicas); ``rows.py``: a batch's rows through the backend to the writer."""
