"""Training: the embedded backbone, experience-conditioned BC examples and the Ray Train LoRA trainer."""
