"""Input data: readers, SentencePiece, corpus preparation and its on-disk format, the Grain pipeline.

Imports nothing from the trainer."""
