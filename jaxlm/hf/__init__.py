"""Hugging Face conversion: export to and import from transformers checkpoints."""
