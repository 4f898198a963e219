"""Rollouts: Ray actors hosting environments, and the pool the stream drives."""
