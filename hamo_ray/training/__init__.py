"""Training: the embedded backbone, BC examples, and one training loop for BC and DPO.

Packed batches (``packing``), the loop's parts (``loop``), a stage's epochs and per-step figures
(``stage``), long-lived Ray workers (``group``).
"""
