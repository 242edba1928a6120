"""Pre/post-processing: passes that change what the model takes or hands back (tokenizer, image steps, adapters)."""
