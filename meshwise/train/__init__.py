"""Training: the validated configuration, the trainer (the loop, top to bottom), what it uses."""
