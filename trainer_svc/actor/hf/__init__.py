"""transformers backend of the trainer: `HfActor` (one process, `--backend hf`) and its training backend."""
