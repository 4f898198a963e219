"""Training: the embedded backbone, BC examples, and one training loop for BC and DPO.

Packed batches (``packing``), the loop's parts (``loop``), long-lived Ray workers (``group``).
"""
