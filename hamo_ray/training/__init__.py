"""Training: the embedded backbone, BC examples, and one training loop for BC and DPO.

The typed jobs and results that cross to the workers (``contracts``), packed batches (``packing``),
the loop's parts (``loop``), a stage's epochs and per-step figures (``stage``), long-lived Ray
workers (``group``: ``TrainerGroup.train_bc`` / ``train_dpo``, ``KeptGroup``), the stream's side
(``driver.StageTrainer``).
"""
