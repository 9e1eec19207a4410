"""Input data: readers, tokenizers (SentencePiece, Hugging Face), chat templates and loss weights, corpus
preparation (plan.py: units and the shard plan; engine.py: where its tasks run, locally or on Ray) and its on-disk
format, the Grain pipeline, streaming lanes over raw files (lanes.py), cleaning with datatrove (clean.py).

Imports nothing from the trainer."""
