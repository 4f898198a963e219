"""hamo-ray: HaMo (Harness-Model collaboration for long-horizon continual learning) on Ray.

Importing the package is light: torch, vllm, deepspeed and Ray load only where they are used.
"""

__version__ = "0.1.0"
