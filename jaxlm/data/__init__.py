"""Input data: readers, tokenizers (SentencePiece, Hugging Face), chat templates and loss weights, corpus
preparation and its on-disk format, the Grain pipeline.

Imports nothing from the trainer."""
