"""Data parallelism on Ray: ``--data-parallel-size N`` replicas of the model, each a Ray actor
(``replica.py``), fed batches by this process, the driver (``driver.py``); ``extract``'s batches of
samples and ``generate``'s batches of conversations alike, the difference given as data: a *batch
kind* (``driver.SampleBatches``; ``generate.on_ray.ConversationBatches``)."""
