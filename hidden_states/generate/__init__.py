"""``hidden-states generate``: regenerate the input's replies and write the training rows of the
regenerated conversations with the states the generation computed (docs/guides/generate.md, "On-policy
rows in one pass"). ``command.py``: the run; ``continuous.py``: conversations kept in the engine,
turn by turn, rows to the writer; ``lines.py``: ``regenerated.jsonl``; ``on_ray.py``: the batch
kind Ray replicas run; ``regeneration.py``: what is kept of a conversation and which reply a row
takes its states from."""
