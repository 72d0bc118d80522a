"""Self-certifying rows: each row carries the engine's own log-probabilities at a few positions, and
the proof that its written last-layer state, through the checkpoint's final norm and LM head,
reproduces them within what rounding explains (``certificate``, ``head``)."""
