"""Evaluation: continual-learning metrics over the stage x domain score matrix."""
