"""Training the k26-mini pair: the stdlib corpus, its tokenizer, the target and the DFlash drafter."""
