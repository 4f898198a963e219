"""Backbones: model sources (packaged GGUF files, Hugging Face folders), GGUF conversion, and the embedded toy backbone."""
